"""`colibri batch`: a JSONL file of prompts through one engine, every line sharing the same weight sweeps.

Input lines are `{"id": ..., "prompt": "..."}` or `{"id": ..., "messages": [...]}` with optional sampling fields
(those of SamplingParams; the command's options are the defaults), or lines of OpenAI's Batch input format
(`{"custom_id", "method": "POST", "url": "/v1/chat/completions" or "/v1/completions", "body"}`), whose body is
checked by the server's own request models (server/schema.py) and whose result is a line of OpenAI's Batch output
format (`{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`, the body a
chat.completion or text_completion). A body's `model` is not checked: the job runs --model; what the engine
cannot do one line at a time here (`n` > 1, `logprobs`, `response_format`, `tools`, `stream`, `echo`) is a
malformed line. Each result is one output line, written
whole, flushed and fsynced when its request finishes (in finishing order): a killed run leaves only complete
lines, except at worst a partial last one, which the next run drops. A rerun with the same output skips the ids
already there, so an interrupted job resumes. A malformed input line (bad JSON, bad UTF-8, bad fields) is
reported with its number and skipped; a duplicate id stops the job before anything runs.

The output file is the user's: it is changed only when it parses whole as this command's results (every complete
line a result record, a partial last line one that starts as the writer starts a record), and it is checked,
with the input and the output's directory, before the model loads. Lines end with "\n" alone: ids and texts
may hold U+2028, U+0085 or "\r" (`ensure_ascii=False`), so nothing here splits with `str.splitlines`.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from colibri.core.errors import ColibriError, InputError, OutputError
from colibri.engine.sampling import SamplingParams
from colibri.server import model_id, schema, tools
from colibri.server.replies import usage

RECORD_START = b'{"id": '  # the bytes every result line starts with (Output.write: json.dumps of a dict, "id" first)
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "seed", "stop", "ignore_eos")
# OpenAI Batch input: the endpoints a line may name, and the request model that checks its body
OPENAI_URLS = {"/v1/chat/completions": schema.ChatRequest, "/v1/completions": schema.CompletionRequest}
OPENAI_FIELDS = ("custom_id", "method", "url", "body")


@dataclass
class Line:
    number: int  # 1-based line number in the input
    id: object
    prompt: str | list[int] | None
    messages: list[dict] | None
    sampling: dict
    url: str | None = None  # an OpenAI Batch line's endpoint (its result is written in that format); None: ours
    ignored: tuple[str, ...] = ()  # the body's parameters Colibri does not know (OpenAI lines; reported)

    @property
    def key(self) -> str:
        return id_key(self.id)


def id_key(value) -> str:
    """Ids compare as JSON values: 1 and "1" are different ids."""
    return json.dumps(value, sort_keys=True)


def parse_line(number: int, text: str, defaults: dict) -> Line:
    """One input line, or an InputError saying what is wrong with it."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(f"not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise InputError("not a JSON object")
    if "custom_id" in obj or "body" in obj:
        return parse_openai_line(number, obj, defaults)
    unknown = sorted(set(obj) - {"id", "prompt", "messages", *SAMPLING_FIELDS})
    if unknown:
        raise InputError(f"unknown field(s) {', '.join(unknown)}; known: id, prompt, messages, "
                         + ", ".join(SAMPLING_FIELDS))
    if "id" not in obj or isinstance(obj["id"], (bool, dict, list)) or obj["id"] is None:
        raise InputError('needs an "id" (a string or a number)')
    prompt, messages = obj.get("prompt"), obj.get("messages")
    if (prompt is None) == (messages is None):
        raise InputError('needs exactly one of "prompt" (a string) or "messages" (a list of chat messages)')
    if prompt is not None and (not isinstance(prompt, str) or not prompt):
        raise InputError('"prompt" must be a non-empty string')
    if messages is not None and (not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages)):
        raise InputError('"messages" must be a non-empty list of {"role": str, "content": str}')
    sampling = {**defaults, **{k: obj[k] for k in SAMPLING_FIELDS if k in obj}}
    SamplingParams(**sampling)  # an InputError naming the bad field
    return Line(number, obj["id"], prompt, messages, sampling)


def parse_openai_line(number: int, obj: dict, defaults: dict) -> Line:
    """One line of OpenAI's Batch input format, its body checked as the server checks a request's."""
    unknown = sorted(set(obj) - set(OPENAI_FIELDS))
    if unknown:
        raise InputError(f"unknown field(s) {', '.join(unknown)} in an OpenAI Batch line; known: "
                         + ", ".join(OPENAI_FIELDS))
    if not isinstance(obj.get("custom_id"), str) or not obj["custom_id"]:
        raise InputError('needs a "custom_id" (a non-empty string)')
    if obj.get("method") != "POST":
        raise InputError('"method" must be "POST"')
    kind = OPENAI_URLS.get(obj.get("url"))
    if kind is None:
        raise InputError(f'"url" must be one of {", ".join(OPENAI_URLS)} (got {obj.get("url")!r})')
    if not isinstance(obj.get("body"), dict):
        raise InputError('"body" must be a JSON object (the request)')
    try:
        req = schema.validate(kind, obj["body"])
        schema.refuse_unsupported(req)
        sampling = schema.given_sampling(req)
    except schema.APIError as e:
        raise InputError(f"body: {e.message}") from None
    wanted = [name for name, on in (("n > 1", (req.n or 1) > 1), ("stream", req.stream),
                                    ("logprobs", schema.logprobs_wanted(req) is not None),
                                    ("echo", getattr(req, "echo", None)), ("tools", getattr(req, "tools", None)),
                                    ("response_format", getattr(req, "response_format", None) is not None
                                     and req.response_format.type != "text")) if on]
    if wanted:
        raise InputError(f"body: {', '.join(wanted)} is not supported by colibri batch; serve the model for it")
    max_tokens = getattr(req, "max_completion_tokens", None)
    max_tokens = req.max_tokens if max_tokens is None else max_tokens
    if max_tokens is not None:
        if max_tokens < 1:  # as the server answers it
            raise InputError(f"body: max_tokens must be at least 1 (got {max_tokens})")
        sampling["max_tokens"] = max_tokens
    sampling = {**defaults, **sampling}
    SamplingParams(**sampling)
    prompt = messages = None
    if kind is schema.ChatRequest:
        messages = tools.template_messages(req.messages)
    elif isinstance(req.prompt, str) or all(isinstance(t, int) for t in req.prompt):
        prompt = req.prompt  # text or token ids
    else:
        raise InputError('body: "prompt" must be one string or one list of token ids in colibri batch (one line,'
                         " one prompt)")
    return Line(number, obj["custom_id"], prompt, messages, sampling, obj["url"], tuple(schema.ignored(req)))


def read_input(path: Path, defaults: dict, report) -> tuple[list[Line], int]:
    """The valid lines of the input and the number of malformed ones (reported and skipped); duplicate ids are an
    InputError."""
    lines, seen, bad = [], {}, 0
    if path.is_dir():
        raise InputError(f"{path}: --input is a directory; give a JSONL file")
    try:
        f = open(path, "rb")  # lines split at b"\n" only; each decoded on its own, so one bad byte costs one line
    except OSError as e:
        raise InputError(f"{path}: cannot read the input ({e.strerror})") from None
    with f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise InputError(f"not valid UTF-8 (byte {e.start + 1} of the line)") from None
                line = parse_line(number, text, defaults)
            except InputError as e:
                report(f"{path}:{number}: skipped: {e}")
                bad += 1
                continue
            if line.ignored:
                report(f"{path}:{number}: ignored parameters colibri does not know: {', '.join(line.ignored)}")
            if line.key in seen:
                raise InputError(f"{path}: id {line.id!r} is on line {seen[line.key]} and line {number}; ids must"
                                 " be unique (nothing was run)")
            seen[line.key] = number
            lines.append(line)
    return lines, bad


def _record_id(raw: bytes) -> str | None:
    """The id key of one result line, None where it is not one."""
    try:
        obj = json.loads(raw.decode("utf-8"))
    except ValueError:  # JSONDecodeError and UnicodeDecodeError both
        return None
    if isinstance(obj, dict) and "custom_id" in obj and "response" in obj:  # OpenAI Batch output
        return id_key(obj["custom_id"])
    if not isinstance(obj, dict) or "id" not in obj or "text" not in obj:
        return None
    return id_key(obj["id"])


def finished_ids(path: Path, report) -> set[str]:
    """Ids already in the output. Nothing is changed unless the file parses whole as results: then a partial last
    line (a run killed while writing it) is cut off, and a whole last record missing only its newline gets it.
    A device or pipe (`/dev/stdout`) holds no results to resume from."""
    if path.is_dir():
        raise InputError(f"{path}: --output is a directory; give a file path")
    if not path.is_file():
        return set()
    try:
        data = path.read_bytes()
    except OSError as e:
        raise InputError(f"{path}: cannot read the output to resume from it ({e.strerror})") from None
    *complete, tail = data.split(b"\n")
    done = set()
    for number, raw in enumerate(complete, 1):
        key = _record_id(raw)
        if key is None:
            raise InputError(f"{path}:{number}: not a result line of colibri batch; give another --output (the file"
                             " was left as it is)")
        done.add(key)
    if tail:
        key = _record_id(tail)
        if key is None and not tail.startswith(RECORD_START):
            raise InputError(f"{path}:{len(complete) + 1}: not a result line of colibri batch; give another"
                             " --output (the file was left as it is)")
        with open(path, "r+b") as f:
            if key is None:
                f.truncate(len(data) - len(tail))
            else:
                f.seek(len(data))
                f.write(b"\n")
            os.fsync(f.fileno())
        if key is None:
            report(f"{path}: dropped a partial last line left by an interrupted run; its id runs again")
        else:
            done.add(key)
    return done


def check_writable(path: Path) -> None:
    """OutputError unless results can be appended to path (before the model loads: a read-only directory or
    file is found in a second, not after the load). Creates the file, empty, where it is missing."""
    try:
        with open(path, "ab"):
            pass
    except OSError as e:
        raise OutputError(f"{path}: cannot write the results ({e.strerror}); give a writable --output") from None


def line_ids(model, line: Line) -> list[int]:
    """The prompt's token ids: the raw prompt, or the messages through the chat template."""
    if line.prompt is not None:
        return model.prompt_ids(line.prompt)
    return model.chat_ids(line.messages)


def record(model, line: Line, req, start: float) -> dict:
    """The result line of a finished request (`start`: when it was added; perf_counter), in OpenAI's Batch output
    format for a line in its input format."""
    r, m = req.result(), req.metrics
    if line.url is not None:
        return openai_record(model, line, r, m.prefix_tokens)
    return {"id": line.id, "text": r.text, "finish_reason": r.finish_reason,
            "prompt_tokens": r.prompt_tokens, "completion_tokens": len(r.token_ids),
            "cached_prompt_tokens": m.prefix_tokens, "ttft_s": round(m.ttft_s, 4),
            "duration_s": round(time.perf_counter() - start, 4),
            "decode_tokens_per_s": round(m.decode_tokens_per_s, 3)}


def openai_record(model, line: Line, r, cached: int) -> dict:
    """A result line in OpenAI's Batch output format (`r`: the GenerationResult)."""
    tokens = len(r.token_ids)
    body = {"created": int(time.time()), "model": model_id(model.config),
            "usage": usage(r.prompt_tokens, tokens, cached)}
    if line.url == "/v1/chat/completions":
        body = {"id": "chatcmpl-" + secrets.token_hex(12), "object": "chat.completion", **body,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": r.text},
                             "finish_reason": r.finish_reason, "logprobs": None}]}
    else:
        body = {"id": "cmpl-" + secrets.token_hex(12), "object": "text_completion", **body,
                "choices": [{"index": 0, "text": r.text, "finish_reason": r.finish_reason, "logprobs": None}]}
    return {"id": "batch_req_" + secrets.token_hex(12), "custom_id": line.id,
            "response": {"status_code": 200, "request_id": "req_" + secrets.token_hex(12), "body": body},
            "error": None}


def completion_tokens(rec: dict) -> int:
    """The tokens a result line's reply holds, in either output format."""
    if "response" in rec:
        return rec["response"]["body"]["usage"]["completion_tokens"]
    return rec["completion_tokens"]


class Output:
    """The results file, open for appending: each record one whole line, flushed and fsynced (a device or pipe,
    /dev/stdout, has nothing to sync)."""

    def __init__(self, path: Path):
        self.path = path
        self.written = 0
        self.tokens = 0  # completion tokens of the lines written
        self._sync = path.is_file()
        self._f = open(path, "ab", buffering=0)  # unbuffered: a failed write leaves nothing pending

    def write(self, rec: dict) -> None:
        data = (json.dumps(rec, ensure_ascii=False) + "\n").encode()
        try:
            while data:  # one write of the whole line, unless the disk takes only part of it
                data = data[self._f.write(data):]
            if self._sync:
                os.fsync(self._f.fileno())
        except OSError as e:  # disk full, a removed device: what is written stays, a partial line is dropped later
            raise OutputError(f"{self.path}: cannot write the results ({e.strerror}); {self.written} lines are"
                              " written; make room and run the same command again to resume") from None
        self.written += 1
        self.tokens += completion_tokens(rec)

    def close(self) -> None:
        self._f.close()


class Batch:
    """Runs lines through a model's engine, at most `window` requests in it at a time."""

    def __init__(self, model, out: Output, report, window: int):
        self.model, self.out, self.report, self.window = model, out, report, window
        self.skipped = 0

    def run(self, lines: list[Line], bar) -> None:
        eng = self.model.engine
        todo, active = deque(lines), {}
        t0 = time.perf_counter()
        while todo or active:
            while todo and len(active) < self.window:
                line = todo.popleft()
                try:
                    req = eng.add_request(line_ids(self.model, line), SamplingParams(**line.sampling))
                except ColibriError as e:
                    self.skip(line, e, bar)
                    continue
                active[req] = (line, time.perf_counter())
            eng.step()
            for req in [r for r in active if r.finished]:
                line, start = active.pop(req)
                if req.error is not None:
                    self.skip(line, req.error, bar)
                    continue
                self.out.write(record(self.model, line, req, start))
                bar.update(1)
            tokens = sum(r.metrics.generated_tokens for r in active) + self.out.tokens
            bar.set_postfix_str(f"{tokens / (time.perf_counter() - t0):.1f} tok/s", refresh=False)

    def skip(self, line: Line, error, bar) -> None:
        self.report(f"line {line.number} (id {line.id!r}): skipped: {error}")
        self.skipped += 1
        bar.update(1)

    def close(self) -> None:
        self.model.close()


def run(args, sampling_defaults: dict, start) -> int:
    """The `colibri batch` command: 0 when every line has its result, 1 when some were skipped. `start(out,
    report)` makes the job once the input and output are checked: a Batch on one engine, or the cluster's
    (colibri.cluster); it has run(lines, bar), skipped and close()."""
    from tqdm import tqdm

    def report(text: str) -> None:
        tqdm.write(f"colibri batch: {text}", file=sys.stderr)

    src, dst = Path(args.input), Path(args.output)
    if src.resolve() == dst.resolve():
        raise InputError("--input and --output are the same file; write the results elsewhere")
    defaults = {k: v for k, v in sampling_defaults.items() if v is not None}
    lines, bad = read_input(src, defaults, report)
    done = finished_ids(dst, report)
    todo = [line for line in lines if line.key not in done]
    if len(lines) > len(todo):
        report(f"{len(lines) - len(todo)} of {len(lines)} ids already in {dst}: skipped (resuming)")
    if not todo:
        report("nothing to do")
        return 1 if bad else 0
    check_writable(dst)
    out = Output(dst)
    try:
        job = start(out, report)
        with tqdm(total=len(todo), unit="line", desc="batch", file=sys.stderr, dynamic_ncols=True) as bar:
            try:
                job.run(todo, bar)
            except BaseException:  # Ctrl-C, SIGTERM or an error: what is written stays, complete
                bar.close()
                report(f"stopped after {out.written} of {len(todo)} lines; run the same command again to resume")
                raise
            finally:
                job.close()
    finally:
        out.close()
    skipped = bad + job.skipped
    report(f"wrote {out.written} lines to {dst}" + (f"; {skipped} lines skipped (see above)" if skipped else ""))
    return 1 if skipped else 0


def local(args, load_model):
    """`start` for run(): one engine in this process, with twice its sequences in flight."""
    def start(out: Output, report) -> Batch:
        model = load_model(args)
        return Batch(model, out, report, window=2 * model.max_sequences)
    return start
