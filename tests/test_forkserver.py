"""The tests' fork server starts a program as a fresh interpreter would (tests/forkserver.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from tests import forkserver
from tests.conftest import ROOT

SHOW = ("import json, os, random, sys, numpy, torch; "
        "print(json.dumps({'argv': sys.argv, 'cwd': os.getcwd(), 'env': os.environ.get('FORKSERVER_TEST'), "
        "'path0': sys.path[0], 'pid': os.getpid(), 'torch': torch.initial_seed(), 'random': random.random(), "
        "'numpy': float(numpy.random.rand()), 'threads': torch.get_num_threads(), 'main': __name__}))")


def test_a_forked_program_gets_its_argv_cwd_environment_and_new_seeds(tmp_path):
    env = dict(os.environ, FORKSERVER_TEST="yes", OMP_NUM_THREADS="1")
    runs = [forkserver.run([sys.executable, "-c", SHOW, "one", "two"], capture_output=True, text=True, cwd=tmp_path,
                           env=env, timeout=60) for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), [r.stderr for r in runs]
    first, second = (json.loads(r.stdout) for r in runs)
    assert first["argv"] == ["-c", "one", "two"] and first["cwd"] == str(tmp_path) and first["env"] == "yes"
    assert first["path0"] == "" and first["main"] == "__main__" and first["threads"] == 1
    assert first["pid"] != second["pid"] and first["pid"] != os.getpid()
    for seeded in ("torch", "random", "numpy"):
        assert first[seeded] != second[seeded], seeded


def test_a_forked_module_and_script_run_as_main_with_their_exit_status_and_streams(tmp_path):
    script = tmp_path / "script.py"
    script.write_text("import sys\nprint(sys.argv[1:], sys.path[0], input())\nsys.stderr.write('bye\\n')\nsys.exit(3)\n")
    done = forkserver.run([sys.executable, str(script), "x"], input="typed\n", capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 3 and done.stdout == f"['x'] {tmp_path} typed\n" and done.stderr == "bye\n"
    helped = forkserver.run([sys.executable, "-m", "potluck", "--help"], capture_output=True, text=True, cwd=ROOT,
                            timeout=60)
    assert helped.returncode == 0 and helped.stdout.startswith("usage: potluck"), helped.stderr
    failed = forkserver.run([sys.executable, "-c", "raise ValueError('told')"], capture_output=True, text=True,
                            timeout=60)
    assert failed.returncode == 1 and failed.stderr.rstrip().endswith("ValueError: told")


def test_a_forked_program_takes_signals_and_times_out_like_a_child():
    proc = forkserver.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "up\n" and proc.poll() is None
        try:
            proc.wait(0.2)
            raise AssertionError("returned before the program ended")
        except subprocess.TimeoutExpired:
            pass
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == -signal.SIGTERM
    finally:
        proc.kill()
        proc.stdout.close()


def test_what_a_fork_cannot_reproduce_starts_the_ordinary_way():
    """Interpreter options and startup settings the server lacks: a fresh interpreter, not a fork."""
    server = forkserver._the_server()
    assert server.accepts([sys.executable, "-m", "potluck"], None)
    assert not server.accepts([sys.executable, "-X", "importtime", "-c", "pass"], None)
    assert not server.accepts([sys.executable, "-c", "pass"], dict(os.environ, PYTHONHASHSEED="1"))
    assert not server.accepts([sys.executable, "-c", "pass"], dict(os.environ, PYTHONPATH="/elsewhere"))
    assert not server.accepts(["/bin/echo", "hi"], None)
    done = forkserver.run([sys.executable, "-c", "import sys; print(sys.flags.hash_randomization)"],
                          env=dict(os.environ, PYTHONHASHSEED="0"), capture_output=True, text=True, timeout=60)
    assert done.stdout == "0\n", done.stderr  # PYTHONHASHSEED=0 took effect: it did start afresh
