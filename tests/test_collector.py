"""A serving process's garbage collector (specdec.serving.server.settle_collector, ServerConfig.gc_young_objects):
run in a fresh interpreter, since it changes the process's collector for good."""

import json
import subprocess
import sys

SCRIPT = """
import gc, json, sys
from specdec.serving.server import settle_collector
start = [object() for _ in range(1000)]  # what a process builds while it starts
before = gc.get_threshold()
settle_collector(int(sys.argv[1]))
print(json.dumps({"before": before, "after": gc.get_threshold(), "frozen": gc.get_freeze_count()}))
"""


def settled(young: int) -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(young)], check=True, capture_output=True, text=True,
                         timeout=120)
    return json.loads(out.stdout)


def test_a_started_process_freezes_its_heap_and_collects_young_objects_less_often():
    got = settled(10_000)
    assert got["after"] == [10_000, *got["before"][1:]]
    assert got["frozen"] >= 1000  # the start's objects are out of every later collection's scan


def test_zero_leaves_the_collector_as_python_set_it():
    got = settled(0)
    assert got["after"] == got["before"] and got["frozen"] == 0
