"""bench/results/README.md's index is what the results give (`python -m bench.results_index` rewrites it),
and every result it lists is a report with the fields the index reads."""

from __future__ import annotations

import json

from bench import results_index


def test_the_index_is_up_to_date():
    assert results_index.main(["--check"]) == 0, "run python -m bench.results_index"


def test_every_result_is_a_report_with_its_time():
    for path in sorted(results_index.RESULTS.rglob("*.json")):
        report = json.loads(path.read_text())
        assert {"bench", "machine", "figures"} <= report.keys(), path
        assert report["machine"].get("time"), path


def test_a_row_shows_the_named_ratios_or_the_first_four():
    report = {"bench": "engine", "ratios": {"spec_ngram": 3.0, "decode_b1": 9.2379, "prefill_512": 1.3293}}
    assert results_index.headline(report) == "`decode_b1` 9.24, `prefill_512` 1.33"
    other = {"bench": "new", "ratios": {f"r{i}": float(i) for i in range(6)}}
    assert results_index.headline(other) == "`r0` 0, `r1` 1, `r2` 2, `r3` 3"
    failed = {"bench": "chaos", "ok": False, "figures": {"hung": 2}}
    assert results_index.headline(failed) == "**failed**, hung 2"
