"""`colibri doctor`: each check's verdict from the facts a `Host` reports (faked here: a filesystem without
O_DIRECT, THP 'never', a host-cached disk, a cgroup limit), the container sample, and the command's JSON."""

from __future__ import annotations

import errno
import json
from collections import namedtuple

import pytest

from colibri import cli
from colibri.convert import pipeline as conv
from colibri.perf import doctor
from colibri.perf.doctor import FAIL, INFO, OK, WARN, Host


def _refuse_direct(path: str) -> int:
    raise OSError(errno.EINVAL, "Invalid argument")


def by_name(checks) -> dict:
    return {c.name: c for c in checks}


def test_no_o_direct_and_thp_never_are_flagged_with_what_to_do(tmp_path):
    host = Host(open_direct=_refuse_direct, fs_type=lambda p: "tmpfs", thp_mode=lambda: "never")
    checks = by_name(doctor.diagnose(directory=tmp_path, host=host))
    d = checks["O_DIRECT"]
    assert d.status == FAIL and "tmpfs filesystem refuses O_DIRECT" in d.verdict and "ext4" in d.action
    t = checks["huge pages"]
    assert t.status == WARN and "'never'" in t.verdict
    assert t.action == "as root: echo madvise > /sys/kernel/mm/transparent_hugepage/enabled"
    assert not list(tmp_path.iterdir())  # the scratch file is gone
    text = doctor.format_checks(list(checks.values()))
    assert "[fail] O_DIRECT" in text and text.endswith("1 failing, 1 warning")


def test_the_real_host_reads_o_direct_and_thp(tmp_path):
    checks = by_name(doctor.diagnose(directory=tmp_path))
    assert checks["O_DIRECT"].status in (OK, FAIL)
    assert checks["huge pages"].data["mode"] in ("always", "madvise", "never", None)
    assert checks["torch"].data["threads"] >= 1
    assert checks["swap disk"].data["free"] > 0


@pytest.mark.parametrize("first,repeat,size,virtual,verdict,status", [
    (1e9, 5e9, 64 << 30, True, "host-cached", WARN),  # a repeat far faster: the host caches
    (2e9, 2.1e9, 64 << 30, True, "cold or host-cached", INFO),  # a VM disk cannot rule the host cache out
    (2e9, 2.1e9, 64 << 30, False, "cold", OK),
    (2e9, 2e9, 1 << 30, False, "cached", INFO),  # the pass read more than the file: read again from a cache
])
def test_read_speed_says_cold_or_cached(tmp_path, first, repeat, size, virtual, verdict, status):
    f = tmp_path / "model.bin"
    with open(f, "wb") as fh:
        fh.truncate(size)  # sparse: only its size is read
    rates = iter([first, repeat])
    host = Host(bandwidth=lambda path, seconds: next(rates), virtual_disk=lambda p: virtual)
    c = doctor.check_read_speed(str(f), host, seconds=1.0)
    assert c.data["verdict"] == verdict and c.status == status
    assert f"first pass {first / 1e9:.2f} GB/s, repeat {repeat / 1e9:.2f} GB/s" in c.verdict


def test_memory_names_the_binding_cgroup_limit():
    host = Host(meminfo=lambda: {"MemTotal": 32 << 30, "MemAvailable": 30 << 30}, cgroup_limit=lambda: 4 << 30)
    c = doctor.check_memory(host, model_bytes=8 << 30)
    assert c.status == WARN and "cgroup limit 4.0 GiB" in c.verdict and "binds" in c.verdict
    assert c.action.startswith("run with --memory-limit under 3.2 GiB")
    assert doctor.check_memory(host, model_bytes=1 << 30).status == OK


def test_kernels_verdict_names_the_tier_and_why():
    report = {"cpu_flags": {"avx2": False, "fma": True}, "setting": "auto", "compiler": None,
              "tiers": [{"name": "portable", "built": False, "error": None}, {"name": "torch", "built": None,
                                                                                "error": None}],
              "pick": {"tier": "torch", "why": "avx2 needs avx2; portable is not built and there is no C++"
                                              " compiler"}}
    k = doctor.check_kernels(report)
    assert k.status == WARN and "no C++ compiler" in k.verdict and "g++" in k.action
    assert doctor.check_cpu(report).status == WARN


def test_swap_disk_full():
    usage = namedtuple("usage", "total used free")
    c = doctor.check_swap_disk("/x", Host(disk_usage=lambda d: usage(10 << 30, 9.5 * 2**30, 512 << 20)))
    assert c.status == WARN and "free disk space" in c.action


def test_container_sample_finds_a_damaged_page(tiny_model_dir, tmp_path):
    out = tmp_path / "c"
    conv.convert(tiny_model_dir("llama"), out, conv.ConvertOptions(quant="q4", group_size=32))
    good = doctor.check_container(out)
    assert good.status == OK and good.data["version"] == 3 and good.data["bad_pages"] == []
    m = json.loads((out / "manifest.json").read_text())
    last = m["pages"][-1]  # the sample always holds the first and the last page
    f = out / m["files"][last["file"]]["name"]
    data = bytearray(f.read_bytes())
    data[last["offset"] + 5] ^= 0x01
    f.write_bytes(data)
    bad = doctor.check_container(out)
    assert bad.status == FAIL and bad.data["bad_pages"] == [last["id"]] and "colibri verify" in bad.action


def test_cli_json_and_exit_status(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "c"
    conv.convert(tiny_model_dir("llama"), out, conv.ConvertOptions(quant="q8"))
    code = cli.main(["doctor", "--model", str(out), "--json", "--probe-seconds", "0.05"])
    report = json.loads(capsys.readouterr().out)
    names = [c["name"] for c in report["checks"]]
    assert names == ["O_DIRECT", "disk read", "huge pages", "memory", "CPU", "torch", "kernels", "swap disk",
                     "container"]
    assert code == (1 if any(c["status"] == FAIL for c in report["checks"]) else 0)
    read = report["checks"][1]
    assert read["data"]["verdict"] == "cached"  # a tiny container is smaller than one pass reads
    assert cli.main(["doctor", "--model", str(tmp_path / "nope")]) == 2
    assert "no such file or directory" in capsys.readouterr().err
