import argparse

import pytest

from common.config import ConfigError, ServerArgs


def parse(*argv: str) -> ServerArgs:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(parser.parse_args(list(argv)))


def test_defaults_and_sglang_flag_names():
    args = parse("--tp-size", "2", "--page-size", "32", "--disaggregation-transfer-backend", "nixl",
                 "--disable-radix-cache", "--chunked-prefill-size", "64")
    assert args.model == "default"
    assert (args.tp, args.page_size, args.transfer_backend) == (2, 32, "nixl")
    assert args.disable_radix_cache is True and args.chunked_prefill_size == 64
    assert parse("--tp", "4").tp == 4


@pytest.mark.parametrize("argv, flag", [
    (("--page-size", "12"), "--page-size"),
    (("--page-size", "0"), "--page-size"),
    (("--model", "/no/such/dir"), "--model"),
    (("--tp", "0"), "--tp"),
    (("--max-total-tokens", "8"), "--max-total-tokens"),
    (("--chunked-prefill-size", "3"), "--chunked-prefill-size"),
    (("--port", "70000"), "--port"),
    (("--init-new-token-ratio", "0.05"), "--init-new-token-ratio"),
    (("--tp", "2", "--ep-size", "3"), "--ep-size"),
    (("--tp", "2", "--enable-eplb"), "--enable-eplb"),
    (("--ep-num-redundant-experts", "2"), "--ep-num-redundant-experts"),
    (("--tp", "2", "--ep", "2", "--enable-eplb", "--ep-num-redundant-experts", "3"),
     "--ep-num-redundant-experts"),
    (("--tp", "2", "--ep", "2", "--enable-eplb", "--eplb-rebalance-num-iterations", "0"),
     "--eplb-rebalance-num-iterations"),
    (("--enable-dp-attention",), "--enable-dp-attention"),  # needs --dp-size 2 or more
    (("--dp", "2", "--enable-dp-attention", "--pp", "2"), "--enable-dp-attention"),
    (("--dp", "2", "--enable-dp-attention", "--speculative-algorithm", "NGRAM"), "--enable-dp-attention"),
    (("--dp", "2", "--enable-dp-attention", "--enable-overlap-schedule"), "--enable-dp-attention"),
    (("--dp", "2", "--enable-dp-attention", "--ep", "3"), "--ep-size"),  # divides dp x tp = 2
    (("--dp", "2", "--ep", "2"), "--ep-size"),  # without DP attention EP divides tp = 1
])
def test_invalid_settings_name_the_flag(argv, flag):
    with pytest.raises(ConfigError) as e:
        parse(*argv)
    assert str(e.value).startswith(flag)


def test_eplb_settings():
    assert parse("--tp", "2", "--ep", "2").eplb is None
    s = parse("--tp", "4", "--ep", "2", "--enable-eplb", "--ep-num-redundant-experts", "4").eplb
    assert (s.interval, s.redundant_per_rank) == (1000, 2)
    assert parse("--tp", "2", "--ep", "2", "--enable-eplb").eplb.redundant_per_rank == 1


def test_dp_attention_spreads_experts_over_every_group():
    args = parse("--dp", "2", "--tp", "2", "--enable-dp-attention", "--ep", "4")
    assert args.enable_dp_attention and args.ep_size == 4 and args.eplb is None
    eplb = parse("--dp", "2", "--enable-dp-attention", "--ep", "2", "--enable-eplb").eplb
    assert eplb.redundant_per_rank == 1


def test_radix_cache_is_off_on_decode_nodes():
    assert parse().radix_cache_enabled
    assert not parse("--disaggregation-mode", "decode").radix_cache_enabled
    assert not parse("--disable-radix-cache").radix_cache_enabled


def test_unknown_choice_is_refused():
    with pytest.raises(SystemExit):
        parse("--transfer-backend", "carrier-pigeon")
