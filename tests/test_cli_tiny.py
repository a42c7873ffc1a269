"""The `colibri` command on a tiny MoE container given a word-level tokenizer: what `run` and `chat` leave
behind once they return (closing the model saves the expert usage it learned)."""

from __future__ import annotations

import io
import json
import shutil

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

import colibri
import colibri.runtime.model
import colibri.models
from colibri import cli
from colibri.convert import pipeline as conv

WORDS = [f"w{i}" for i in range(300)]
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}w1"


@pytest.fixture(scope="module")
def moe_container(tiny_model_dir, tmp_path_factory):
    """qwen3_moe with a tokenizer (ids below the tiny vocabulary) and a chat template, as a q4 container."""
    root = tmp_path_factory.mktemp("cli_tiny")
    src = root / "src"
    shutil.copytree(tiny_model_dir("qwen3_moe"), src)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(src / "tokenizer.json"))
    (src / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    out = root / "c"
    conv.convert(src, out, conv.ConvertOptions(quant="q4", group_size=32, page_size_mb=1))
    return out


def streaming_limit(path) -> str:
    """Every dense page pinned, room for a few experts: the rest stream, so the store learns usage."""
    ckpt = colibri.models.open_model(path)[0]
    pages = ckpt.pages
    ckpt.close()
    dense = sum(p.nbytes for p in pages if p.kind != "expert")
    expert = max(p.nbytes for p in pages if p.kind == "expert")
    _, reserve, _ = colibri.runtime.model.plan(path, None)
    return str(reserve.total + dense + 4 * expert)


@pytest.mark.parametrize("command", ["run", "chat"])
def test_a_short_run_saves_expert_usage(moe_container, tmp_path, command, monkeypatch, capsys):
    path = tmp_path / "c"
    shutil.copytree(moe_container, path)
    (path / "usage.json").unlink(missing_ok=True)
    options = ["--model", str(path), "--memory-limit", streaming_limit(path), "--max-tokens", "3"]
    if command == "run":
        argv = ["run", "--raw", "--prompt", "w5 w6 w7 w8", *options]
    else:
        argv = ["chat", *options]
        monkeypatch.setattr("sys.stdin", io.StringIO("w5 w6 w7\n"))
    assert cli.main(argv) == 0, capsys.readouterr().err
    usage = json.loads((path / "usage.json").read_text())  # written when the command closed the model
    assert sum(map(sum, usage["counts"])) > 0


def test_the_usual_habits_positional_prompt_short_options_version_and_bare_help(moe_container, capsys):
    """Issue 26 item 4 (in part): `colibri run -m M -n 3 "prompt"` is `run --model M --max-tokens 3 --prompt
    "prompt"` token for token; --version; bare `colibri` prints the help, not an error; two prompts or none are a
    one-line error; `--help` shows the options in sections; bench takes --max-tokens / -n for its --tokens."""
    path = str(moe_container)
    long = ["run", "--raw", "--json", "--model", path, "--max-tokens", "3", "--threads", "1", "--ctx-length", "64"]
    assert cli.main([*long, "--prompt", "w5 w6 w7 w8"]) == 0
    expected = json.loads(capsys.readouterr().out)
    assert cli.main(["run", "--raw", "--json", "-m", path, "-n", "3", "-t", "1", "-c", "64", "w5 w6 w7 w8"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["token_ids"] == expected["token_ids"] and len(got["token_ids"]) == 3
    assert cli.main(["run", "--raw", "--json", "-m", path, "-n", "3", "-p", "w5 w6 w7 w8"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == expected["token_ids"]
    for argv, says in ((["run", "-m", path, "-p", "w5", "w6"], "give the prompt once"),
                       (["run", "-m", path], "no prompt: colibri run")):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1 and "Traceback" not in err
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"colibri {colibri.__version__}"
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: colibri") and "run" in out and "serve" in out
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    sections = [ln for ln in capsys.readouterr().out.splitlines() if ln.endswith(":") and not ln.startswith(" ")]
    assert sections == ["positional arguments:", "options:", "model, threads and memory:",
                        "engine: sequences, speculation, lookahead:", "KV cache:", "sampling:"]
    # bench counts its tokens as run does: --max-tokens and -n are its --tokens
    parser = cli.build_parser()
    for flag in ("--tokens", "--max-tokens", "-n"):
        assert parser.parse_args(["bench", "-m", path, flag, "7"]).tokens == 7


def test_notices_go_through_one_logger_that_q_and_v_set(moe_container, capsys, monkeypatch):
    """Issue 26 item 4: the notices (`colibri: ...` lines on stderr) go through the "colibri" logger, their text
    unchanged: -q hides notices but not the warnings of lossy re-quantization, -v adds debug lines (which kernels
    run); --help names an option's environment variable whether or not it is set."""
    from colibri import kernels
    from colibri.core import log
    argv = ["run", "--raw", "-m", str(moe_container), "-n", "2", "-t", "1", "-c", "64", "w5 w6"]
    try:
        for flags, shown in (([], False), (["-v"], True), (["-q"], False)):
            kernels.use(None)  # resolved again: the debug line is written once per resolution
            assert cli.main([*argv, *flags]) == 0
            err = capsys.readouterr().err
            assert (f"colibri: the {kernels.tier()} kernels run" in err) == shown, (flags, err)
            log.notice("colibri: notice: a notice")
            log.warn("colibri: notice: 3 Q5_K tensors ... re-quantized (lossy)")
            log.debug("colibri: a debug line")
            err = capsys.readouterr().err.splitlines()
            assert ("colibri: notice: a notice" in err) == (flags != ["-q"])
            assert "colibri: notice: 3 Q5_K tensors ... re-quantized (lossy)" in err
            assert ("colibri: a debug line" in err) == (flags == ["-v"])
        assert cli.main([*argv, "-q", "-v"]) == 2
        assert capsys.readouterr().err == "error: give -q (notices hidden) or -v (debug lines too), not both\n"
    finally:
        log.set_level()
    monkeypatch.delenv("COLIBRI_MODEL", raising=False)
    with pytest.raises(SystemExit):
        cli.main(["info", "--help"])
    assert "[env COLIBRI_MODEL]" in " ".join(capsys.readouterr().out.split())
