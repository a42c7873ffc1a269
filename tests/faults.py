"""Fault injection shared by tests that kill a process mid-way."""

# Python source that makes `colibri.convert` (bound as `c`) stop, asleep, right after its journal records
# `{pages}` finished pages: a test kills the process there to interrupt a conversion at a known point.
PAUSE_AFTER_PAGES = (
    "import sys, time; from colibri import convert as c; _write = c.write_json\n"
    "def _paused(path, obj, **kw):\n"
    "    _write(path, obj, **kw)\n"
    "    if path.name == c.JOURNAL and len(obj['pages']) >= {pages}: time.sleep(3600)\n"
    "c.write_json = _paused\n")
