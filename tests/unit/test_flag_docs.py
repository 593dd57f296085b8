"""docs/flags.md is what the parsers say: every flag of every command, with its default."""

from deploy import flag_docs


def test_flags_page_is_current():
    with open(flag_docs.PAGE, encoding="utf-8") as f:
        assert f.read() == flag_docs.render(), "docs/flags.md is stale: run python -m deploy.flag_docs"


def test_every_flag_of_every_parser_is_listed():
    text = flag_docs.render()
    for _, _, build in flag_docs.SECTIONS:
        for action in build()._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert f"`{option}`" in text, option


def test_check_fails_on_a_stale_page(tmp_path, monkeypatch):
    stale = tmp_path / "flags.md"
    stale.write_text(flag_docs.render().replace("`--page-size`", "`--old-page-size`"))
    monkeypatch.setattr(flag_docs, "PAGE", str(stale))
    assert flag_docs.main(["--check"]) == 1
    stale.write_text(flag_docs.render())
    assert flag_docs.main(["--check"]) == 0
