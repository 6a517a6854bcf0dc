"""`verifier: code`: hostile programs score 0 and leave the test process and the machine untouched."""

import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

from components.tasks import code_verifier as cv
from composer.data import Example
from composer.registry import VERIFIERS

REPO = Path(__file__).resolve().parents[1]
SURE = replace(cv.DEFAULT_LIMITS, timeout=10.0)  # for programs that must finish, even on a loaded machine


def _sandbox_reason():
    try:
        cv.ensure_sandbox()
        return ""
    except cv.SandboxUnavailable as e:
        return str(e)


REASON = _sandbox_reason()
needs_sandbox = pytest.mark.skipif(bool(REASON), reason=f"no code sandbox here: {REASON}")


def sandbox_procs() -> set:
    """Live (non-zombie) sandbox processes of this test process: uid 65534 or argv naming a sandbox folder, and
    either descended from this process or orphaned. A sandbox that another pytest-xdist worker runs at the same
    time (a code task in a spec's run) descends from a sibling of this process, under the same parent: not ours."""
    me, parent, procs = os.getpid(), os.getppid(), {}
    for p in psutil.process_iter(["ppid", "uids", "cmdline", "status"]):
        procs[p.pid] = p.info
    out = set()
    for pid, info in procs.items():
        try:
            if pid == me or info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if not ((info["uids"] and info["uids"].real == cv.NOBODY) or any(
                    cv.SANDBOX_PREFIX in a for a in info["cmdline"] or [])):
                continue
        except (psutil.Error, TypeError):
            continue
        up, seen = info.get("ppid"), 0
        while up not in (None, 0, 1, me, parent) and up in procs and seen < 256:
            up, seen = procs[up].get("ppid"), seen + 1
        if up != parent:  # ours (up == me) or an orphan (reparented to init): counts
            out.add(pid)
    return out


@pytest.fixture
def clean_machine():
    """Asserts no sandbox process outlives the test, and this process and its parent survive."""
    before, me, parent = sandbox_procs(), os.getpid(), os.getppid()
    yield
    deadline = time.monotonic() + 3
    while (left := sandbox_procs() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"leftover sandbox processes: {left}"
    assert os.getpid() == me and psutil.pid_exists(parent) and os.getppid() == parent
    assert subprocess.run([sys.executable, "-c", "pass"], timeout=30).returncode == 0  # can still fork


def score(program: str, tests: str = "assert f() is None", timeout: float = 2.0, **meta):
    """The verifier's reward for `program` (hostile programs: their attack runs when imported, before `tests`)."""
    ex = Example(prompt="write code", answer=tests, meta={"timeout": timeout, **meta})
    return cv.code_verifier(f"Here is my solution.\n```python\n{program}\n```\n", ex)


# ------------------------------------------------------------------------------ the verifier proper


def test_registered_and_light():
    assert VERIFIERS["code"].load() is cv.code_verifier
    out = subprocess.run([sys.executable, "-c", "import components.tasks, sys; "
                          "print(any(m in sys.modules for m in ('torch', 'transformers', 'math_verify')))"],
                         capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_extract_program():
    assert cv.extract_program("a\n```python\nx = 1\n```\nb\n```py\ny = 2\n```\nend") == "y = 2\n"
    assert cv.extract_program("```\nz = 3\n```") == "z = 3\n"
    assert cv.extract_program("print(1)") == "print(1)"  # no fence: the whole text, when it is Python
    assert cv.extract_program("The answer is obviously 42, see above.") is None
    assert cv.extract_program("") is None
    assert cv.extract_program("```bash\nls\n```") is None


def test_no_code_is_unparsed():
    v = cv.code_verifier("I think the answer is to loop over it.", Example(prompt="p", answer="assert f(1) == 2"))
    assert v.reward == 0 and not v.parsed and "no code" in v.detail


def test_no_tests_is_unparsed():
    v = cv.code_verifier("```python\nx = 1\n```", Example(prompt="p", answer=""))
    assert v.reward == 0 and not v.parsed and "no tests" in v.detail


@needs_sandbox
def test_correct_program_scores_1(clean_machine):
    assert score("def f(x):\n    return x + 1", "assert f(1) == 2\nassert f(-1) == 0", timeout=10).reward == 1.0


@needs_sandbox
def test_wrong_program_scores_0(clean_machine):
    v = score("def f(x):\n    return x * 2", "assert f(1) == 2\nassert f(3) == 4", timeout=10)
    assert v.reward == 0.0 and v.parsed and "AssertionError" in v.detail


@needs_sandbox
def test_tests_from_meta_and_humaneval_entry_point(clean_machine):
    tests = ["def check(candidate):", "    assert candidate(2, 3) == 5"]
    ex = Example(prompt="p", answer="ignored", meta={"timeout": 10, "entry_point": "add", "tests": tests})
    assert cv.code_verifier("```python\ndef add(a, b):\n    return a + b\n```", ex).reward == 1.0
    assert cv.code_verifier("```python\ndef add(a, b):\n    return a - b\n```", ex).reward == 0.0


# ------------------------------------------------------------------------------ hostile programs


@needs_sandbox
def test_infinite_loop(clean_machine):
    t = time.monotonic()
    v = score("while True:\n    pass")
    # stopped by the wall clock, or on a loaded machine by its CPU-time limit first: either stop is the sandbox's
    assert v.reward == 0 and ("timed out" in v.detail or "CPU time limit" in v.detail), v.detail
    assert time.monotonic() - t < 5


@needs_sandbox
def test_sleep_forever_in_a_detached_child(clean_machine):
    v = score("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(1000)\n"
              "time.sleep(1000)")
    assert v.reward == 0  # and clean_machine finds no orphan


@needs_sandbox
def test_fork_bomb(clean_machine):
    # forks as fast as the kernel lets it, and backs off a little when refused: the process cap is under test here
    # (test_infinite_loop is the one for a program that spins), and 16 spinning processes on a 2-core machine
    # would starve the sampler below, leaving the test nothing to measure
    program = ("import os, time\nwhile True:\n    try:\n        if os.fork() == 0:\n            os.setsid()\n"
               "    except OSError:\n        time.sleep(0.01)")
    samples = []  # (began, ended, sandbox processes seen): a sample on a loaded machine can take a second
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            began = time.monotonic()
            n = len(sandbox_procs())
            samples.append((began, time.monotonic(), n))
            time.sleep(0.05)

    w = threading.Thread(target=watch)
    w.start()
    start = time.monotonic()
    try:
        v = score(program, timeout=5.0)  # the bomb runs until its timeout: long enough to be sampled while it runs
    finally:
        end = time.monotonic()
        stop.set()
        w.join()
    assert v.reward == 0 and "timed out" in v.detail, v.detail
    # a sample that overlaps the bomb's run counts (on a loaded machine one sample can take seconds); one that saw
    # no process at all leaves the test inconclusive, which fails it
    during = [n for began, ended, n in samples if ended > start and began < end]
    assert during and max(during) > 0, f"no sample of the machine saw the bomb: {samples} (run {start}..{end})"
    assert max(during) <= cv.DEFAULT_LIMITS.nproc + 2  # RLIMIT_NPROC holds (+ unshare, + a racing sample)


@needs_sandbox
def test_memory_bomb(clean_machine):
    v = score("x = bytearray(8 << 30)")
    assert v.reward == 0 and "MemoryError" in v.detail
    v = score("chunks = []\nwhile True:\n    chunks.append(bytearray(128 << 20))")  # touches every page
    assert v.reward == 0 and any(w in v.detail for w in ("MemoryError", "timed out", "CPU time limit")), v.detail


@needs_sandbox
def test_write_outside_its_folder(clean_machine):
    tag = uuid.uuid4().hex
    targets = [Path(f"/tmp/pwned-{tag}"), Path(f"/var/tmp/pwned-{tag}"), Path(f"/dev/shm/pwned-{tag}"),
               REPO / f"pwned-{tag}", Path.home() / f"pwned-{tag}"]
    program = "ok = 0\n" + "".join(
        f"try:\n    open({str(t)!r}, 'w').write('x')\n    ok += 1\nexcept OSError:\n    pass\n" for t in targets
    ) + f"assert ok == {len(targets)}, ok\n"
    try:
        v = score(program)
        assert v.reward == 0
        assert not any(t.exists() for t in targets)
    finally:
        for t in targets:
            t.unlink(missing_ok=True)


@needs_sandbox
def test_file_size_limit(clean_machine):
    v = score("open('big', 'wb').write(b'x' * (64 << 20))")
    assert v.reward == 0


@needs_sandbox
def test_environment_is_empty(clean_machine, monkeypatch):
    secret = uuid.uuid4().hex
    monkeypatch.setenv("COMPOSER_TEST_SECRET", secret)
    program = (f"import glob, os\nfound = {secret!r} in repr(dict(os.environ))\n"
               "for p in glob.glob('/proc/*/environ'):\n    try:\n"
               f"        found |= {secret!r}.encode() in open(p, 'rb').read()\n    except OSError:\n        pass\n"
               f"try:\n    found |= {secret!r}.encode() in open('/proc/{os.getpid()}/environ', 'rb').read()\n"
               "except OSError:\n    pass\nassert found")
    assert score(program).reward == 0
    r = cv.run_sandboxed("import os; print(sorted(os.environ))", SURE)
    assert r.ok and set(eval(r.stdout)) <= {"LC_CTYPE"}  # only what Python's own locale coercion sets


@needs_sandbox
def test_socket_to_a_local_listener(clean_machine):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.setblocking(False)
    port = srv.getsockname()[1]
    try:
        program = (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
                   "s.sendall(b'stolen')")
        assert score(program).reward == 0
        with pytest.raises(BlockingIOError):
            srv.accept()  # nobody connected
    finally:
        srv.close()


@needs_sandbox
def test_socket_to_the_outside(clean_machine):
    program = ("import socket\ns = socket.create_connection(('1.1.1.1', 80), timeout=1)\n"
               "s.sendall(b'GET / HTTP/1.0\\r\\n\\r\\n')")
    assert score(program).reward == 0
    assert score("import socket\nsocket.getaddrinfo('example.com', 80)").reward == 0
    # no route at all (no traffic), and no interface but loopback
    r = cv.run_sandboxed("import errno, socket\ntry:\n    socket.create_connection(('1.1.1.1', 80), timeout=1)\n"
                         "except OSError as e:\n    print(errno.errorcode[e.errno])\n"
                         "lines = open('/proc/net/dev').read().splitlines()[2:]\n"
                         "print(sorted(line.split(':')[0].strip() for line in lines))",
                         SURE)
    assert r.ok and r.stdout.split() == ["ENETUNREACH", "['lo']"], r.stdout + r.stderr


@needs_sandbox
@pytest.mark.parametrize("attack", [
    "os.kill(os.getppid(), 9)",
    "os.killpg(os.getpgid(os.getppid()), 9)",
    "os.killpg(os.getpgrp(), 9)",
    "os.kill({me}, 9)",
    "os.killpg(os.getpgid({me}), 9)",
    "os.kill(-1, 9)",
], ids=["ppid", "killpg-ppid", "killpg-own", "test-pid", "killpg-test", "kill-all"])
def test_kill_the_parent(clean_machine, attack):
    me = os.getpid()
    v = score(f"import os, time\n{attack.format(me=me)}\ntime.sleep(0.2)\nassert False, 'still here'")
    assert v.reward == 0
    assert psutil.pid_exists(me)


# ------------------------------------------------------------------------------ fail closed


@pytest.fixture
def fake_dir():
    """A folder the sandbox user may execute from (pytest's tmp_path is private to root)."""
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="fake-unshare-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _fake_unshare(folder, body: str) -> str:
    fake = folder / "unshare"
    fake.write_text("#!/bin/sh\n" + body)
    fake.chmod(0o755)
    return str(fake)


def test_refuses_without_namespaces(fake_dir, monkeypatch):
    """An `unshare` that ignores its options: the in-sandbox checks refuse to run the code."""
    marker = Path(f"/tmp/pwned-{uuid.uuid4().hex}")
    monkeypatch.setattr(cv, "_unshare", lambda: _fake_unshare(
        fake_dir, 'while [ "${1#-}" != "$1" ]; do shift; done\nexec "$@"\n'))
    with pytest.raises(cv.SandboxUnavailable, match="refusing to run code"):
        score(f"open({str(marker)!r}, 'w').write('x')")
    assert not marker.exists()


@pytest.mark.skipif(not os.path.exists("/usr/bin/unshare"), reason="needs util-linux unshare")
def test_refuses_without_network_namespace(fake_dir, monkeypatch):
    """A sandbox that would keep the host network is refused before the program runs."""
    monkeypatch.setattr(cv, "_unshare", lambda: _fake_unshare(
        fake_dir, 'for x in "$@"; do [ "$x" = --net ] || set -- "$@" "$x"; shift; done\n'
                  'exec /usr/bin/unshare "$@"\n'))
    with pytest.raises(cv.SandboxUnavailable, match="network interfaces"):
        score("print('hello')")


def test_refuses_without_unshare(monkeypatch):
    def missing():
        raise cv.SandboxUnavailable("`unshare` (util-linux) is not installed: refusing to run code")

    monkeypatch.setattr(cv, "_unshare", missing)
    with pytest.raises(cv.SandboxUnavailable):
        score("print('hello')")


# ------------------------------------------------------------------------------ forged rewards (issue 17)
# A wrong solution must never score 1 by ending the process "successfully" before or around its tests:
# a pass is the harness's own nonce line, written after the last test, on a pipe the program never holds.

WRONG = "def f(x):\n    return 0\n"
FORGERIES = {
    "system_exit_0": WRONG + "raise SystemExit(0)\n",
    "os_exit_0": WRONG + "import os\nos._exit(0)\n",
    "excepthook": WRONG + "import os, sys\nsys.excepthook = lambda *a: os._exit(0)\n",
    "atexit": WRONG + "import atexit, os\natexit.register(lambda: os._exit(0))\n",
    "reexec_without_asserts": WRONG + ("import os, sys\nif not sys.flags.optimize:\n"
                                       "    os.execv(sys.executable, [sys.executable, '-O', '-I', 'main.py'])\n"),
    "always_equal": "class E:\n    def __eq__(self, other):\n        return True\n    __hash__ = None\n"
                    "def f(x):\n    return E()\n",
    "int_subclass_equal": "class E(int):\n    def __eq__(self, other):\n        return True\ndef f(x):\n    return E(0)\n",
    "patch_assertion_error": WRONG + "import builtins\nbuiltins.AssertionError = type('X', (BaseException,), {})\n",
    "write_a_pass_to_every_fd": WRONG + ("import os\nfor fd in range(64):\n    try:\n"
                                         "        os.write(fd, b'{\"result\": \"pass\", \"nonce\": \"0\"}\\n')\n"
                                         "    except OSError:\n        pass\n"),
    "fake_the_server": ("import json, os, struct, sys\nresp = int(sys.argv[2])\n"
                        "d = json.dumps({'ready': {}}).encode()\nos.write(resp, struct.pack('>I', len(d)) + d)\n"
                        "os._exit(0)\n"),
    "answer_every_request_with_true": ("import json, os, struct, sys\nreq, resp = int(sys.argv[1]), int(sys.argv[2])\n"
                                       "def send(o):\n    d = json.dumps(o).encode()\n"
                                       "    os.write(resp, struct.pack('>I', len(d)) + d)\n"
                                       "send({'ready': {'f': {'h': 0}}})\nwhile True:\n"
                                       "    n = struct.unpack('>I', os.read(req, 4))[0]\n    os.read(req, n)\n"
                                       "    send({'ok': True})\n"),
    "read_the_harness": WRONG + ("import os\nfor p in ['/proc/1/environ', '/proc/1/mem'] + "
                                 "['/proc/1/fd/' + n for n in os.listdir('/proc/1/fd')]:\n    try:\n"
                                 "        open(p, 'rb').read(1)\n        raise SystemExit('read ' + p)\n"
                                 "    except OSError:\n        pass\n"),
}


@needs_sandbox
@pytest.mark.parametrize("program", sorted(FORGERIES))
def test_a_wrong_program_cannot_forge_a_pass(clean_machine, program):
    tests = "assert f(1) == 2\nassert f(5) == 6\n"
    ex = Example(prompt="p", answer=tests, meta={"timeout": 10})
    assert cv.code_verifier(f"```python\n{FORGERIES[program]}```", ex).reward == 0.0
    right = cv.code_verifier("```python\ndef f(x):\n    return x + 1\n```", ex)
    assert right.reward == 1.0, right.detail  # the same tests do pass a right program


@needs_sandbox
def test_the_program_has_no_capabilities_and_cannot_read_the_harness(clean_machine):
    r = cv.run_sandboxed("import os\nprint(open('/proc/self/status').read())\n"
                         "for p in ('/proc/1/environ', '/proc/1/mem', '/proc/1/maps'):\n    try:\n"
                         "        open(p, 'rb').read(1)\n        print('READ', p)\n    except OSError:\n        pass\n",
                         SURE, tests="pass")
    caps = {line.split(":")[0]: line.split()[1] for line in r.stdout.splitlines() if line.startswith("Cap")}
    assert caps and set(caps.values()) == {"0000000000000000"}, r.stdout
    assert "NoNewPrivs:\t1" in r.stdout and "READ" not in r.stdout
    assert "Seccomp:\t2" in r.stdout  # the filter that keeps memory inside the address space (issue 57)


@needs_sandbox
def test_tests_reach_the_program_through_plain_data_and_handles(clean_machine):
    program = ("class Solution:\n    def two_sum(self, xs, t):\n        seen = {}\n        for i, x in enumerate(xs):\n"
               "            if t - x in seen:\n                return [seen[t - x], i]\n            seen[x] = i\n"
               "def gen(n):\n    yield from range(n)\n"
               "def root(x):\n    if x < 0:\n        raise ValueError('negative')\n    return x ** 0.5\n"
               "TABLE = {'a': (1, 2.5, None, b'x', {3})}\n")
    tests = ("assert Solution().two_sum([2, 7, 11], 9) == [0, 1]\nassert list(gen(3)) == [0, 1, 2]\n"
             "assert root(9) == 3.0\ntry:\n    root(-1)\nexcept ValueError as e:\n    assert 'negative' in str(e)\n"
             "else:\n    assert False\nassert TABLE == {'a': (1, 2.5, None, b'x', {3})}\n"
             "assert isinstance(Solution(), Solution) and len(TABLE) == 1 and 'a' in TABLE\n")
    r = cv.run_sandboxed(program, SURE, tests=tests)
    assert r.passed, r.detail + r.stderr


# ------------------------------------------------------------------------------ the filesystem view (issue 17)


@needs_sandbox
def test_the_sandbox_sees_only_what_the_interpreter_needs_read_only(clean_machine):
    secret = REPO / f"secret-{uuid.uuid4().hex}"
    secret.write_text("host data")
    secret.chmod(0o644)
    try:
        probes = ["/etc/passwd", "/etc", str(REPO), str(REPO / ".git"), str(secret), "/home", "/root", "/work"]
        program = ("import json, os\nseen = [p for p in %r if os.path.exists(p)]\n" % probes
                   + "writable = []\nfor d in ('/', '/usr', '/usr/lib', '/bin', '/dev', '/proc/sys'):\n    try:\n"
                     "        open(os.path.join(d, 'pwned'), 'w').close()\n        writable.append(d)\n"
                     "    except OSError:\n        pass\nopen('/tmp/ok', 'w').write('x')\n"
                     "print(json.dumps({'seen': seen, 'writable': writable, 'root': sorted(os.listdir('/'))}))\n")
        r = cv.run_sandboxed(program, SURE)
        assert r.ok, r.stderr
        got = __import__("json").loads(r.stdout)
        assert got["seen"] == [] and got["writable"] == []
        assert set(got["root"]) <= {"usr", "lib", "lib64", "lib32", "libx32", "bin", "sbin", "dev", "proc", "tmp",
                                    *[p.split("/")[1] for p in (sys.base_prefix, sys.exec_prefix)]}
    finally:
        secret.unlink()


@pytest.mark.parametrize("timeout, ok", [(3, True), (0.5, True), (cv.MAX_CODE_TIMEOUT, True), (0, False),
                                         (-1, False), (1e9, False), (float("nan"), False), (float("inf"), False),
                                         ("10", False), (True, False), ([1], False)])
def test_per_row_timeouts_are_checked(timeout, ok):
    assert (cv.timeout_problem(timeout) is None) is ok
    if not ok:  # the verifier refuses the row (never a huge sandbox limit or a crash)
        v = cv.code_verifier("```python\nx = 1\n```", Example(prompt="p", answer="assert x == 1",
                                                              meta={"timeout": timeout}))
        assert v.reward == 0 and not v.parsed and "timeout" in v.detail


# ------------------------------------------------------------------------------ builtin shadowing (issue 29)
# A wrong solution with a one-line prefix redefining a builtin (or a standard module) the tests call must not
# change what the tests compute: the tests see the builtin, or what they define themselves.

SHADOWS = {
    "abs": ("def abs(x):\n    return 0\n", "assert abs(f(2) - 3.5) < 1e-9\n"),
    "len": ("def len(x):\n    return 3\n", "assert len(f(3)) == 3\n"),
    "sorted": ("def sorted(x, **k):\n    return [1, 2, 3]\n", "assert sorted(f(3)) == [1, 2, 3]\n"),
    "set": ("class set:\n    def __init__(self, *a):\n        pass\n    def __eq__(self, o):\n        return True\n",
            "assert set(f(3)) == {1, 2, 3}\n"),
    "round": ("def round(x, n=0):\n    return 7\n", "assert round(f(7)) == 7\n"),
    "isinstance": ("def isinstance(a, b):\n    return True\n", "assert isinstance(f(1), list)\n"),
    "all": ("def all(x):\n    return True\n", "assert all(v == 1 for v in f(2))\n"),
    "AssertionError": ("class AssertionError(BaseException):\n    pass\n",
                       "try:\n    assert f(1) == [9]\nexcept AssertionError:\n    raise\n"),
    "math": ("class math:\n    isclose = staticmethod(lambda *a, **k: True)\n",
             "assert math.isclose(f(2), 3.5)\n"),
}


@needs_sandbox
@pytest.mark.parametrize("name", sorted(SHADOWS))
def test_a_program_cannot_shadow_what_the_tests_call(clean_machine, name):
    prefix, tests = SHADOWS[name]
    wrong = prefix + "def f(x):\n    return 0\n"
    ex = Example(prompt="p", answer=tests, meta={"timeout": 10})
    v = cv.code_verifier(f"```python\n{wrong}```", ex)
    assert v.reward == 0.0, f"{name}: a wrong program scored 1"


@needs_sandbox
def test_the_tests_own_definitions_and_the_entry_point_win(clean_machine):
    program = "def abs(x):\n    return 0\ndef sum(xs):\n    return 42\ndef g(x):\n    return -x\n"
    tests = "def abs(x):\n    return -x if x < 0 else x\nassert abs(g(3)) == 3\n"  # the tests' own abs
    assert cv.run_sandboxed(program, SURE, tests=tests).passed
    # the data's declared entry point may be named like a builtin; other shadowed builtins stay builtins
    tests = "assert sum([1]) == 42\nassert abs(-2) == 2\n"
    assert cv.run_sandboxed(program, SURE, tests=tests, entry="sum").passed
    assert not cv.run_sandboxed(program, SURE, tests=tests).passed


# ------------------------------------------------------------------------------ iterations ended early (issue 43)
# A StopIteration out of a program's function ended the tests' map / filter / zip: `all(map(...))` of nothing is
# True, so a wrong program scored 1.0. Only the end of the program's own iterator (`next`) may end an iteration.

ENDS_EARLY = {
    "map": "assert all(map(lambda x: f(x) == x + 1, [1, 2, 3]))\n",
    "filter": "assert not list(filter(lambda x: f(x) != x + 1, [1, 2, 3]))\n",
    "zip": "assert all(a == b for a, b in zip(map(f, [1, 2, 3]), [2, 3, 4]))\n",
    "starmap_any": "import itertools\nassert not any(itertools.starmap(lambda x: f(x) != x + 1, [(1,), (2,)]))\n",
}
RAISES = ["StopIteration", "GeneratorExit", "KeyboardInterrupt", "SystemExit"]


@needs_sandbox
@pytest.mark.parametrize("exc", RAISES)
@pytest.mark.parametrize("shape", sorted(ENDS_EARLY))
def test_a_program_raising_cannot_end_the_tests_iteration_early(clean_machine, exc, shape):
    ex = Example(prompt="p", answer=ENDS_EARLY[shape], meta={"timeout": 10})
    v = cv.code_verifier(f"```python\ndef f(x):\n    raise {exc}\n```", ex)
    assert v.reward == 0.0, (exc, shape, v.detail)  # before: StopIteration scored 1.0 on map, filter, zip
    if exc == "StopIteration":
        right = cv.code_verifier("```python\ndef f(x):\n    return x + 1\n```", ex)
        assert right.reward == 1.0, right.detail  # the same tests pass a right program


ITERATION_FORGERIES = {
    # a result whose truth value ends the filter
    "bool_raises": "class R:\n    def __bool__(self):\n        raise StopIteration\ndef f(x):\n    return R()\n",
    # a method, reached through an attribute of the program's object
    "method_raises": "class S:\n    def g(self, x):\n        raise StopIteration\ndef f(x):\n    return S().g(x)\n"
                     "s = S()\n",
    # the program speaks the protocol itself and answers every request 'stop'
    "answer_every_request_with_stop": ("import json, os, struct, sys\nreq, resp = int(sys.argv[1]), int(sys.argv[2])\n"
                                       "def send(o):\n    d = json.dumps(o).encode()\n"
                                       "    os.write(resp, struct.pack('>I', len(d)) + d)\n"
                                       "send({'ready': {'f': {'h': 0}}})\nwhile True:\n"
                                       "    n = struct.unpack('>I', os.read(req, 4))[0]\n    os.read(req, n)\n"
                                       "    send({'stop': True})\n"),
}


@needs_sandbox
@pytest.mark.parametrize("program", sorted(ITERATION_FORGERIES))
def test_a_program_cannot_end_an_iteration_through_its_objects_or_the_protocol(clean_machine, program):
    tests = "assert not list(filter(lambda x: not f(x), [1, 2, 3]))\nassert all(map(lambda x: f(x) == x + 1, [1, 2]))\n"
    ex = Example(prompt="p", answer=tests, meta={"timeout": 10})
    v = cv.code_verifier(f"```python\n{ITERATION_FORGERIES[program]}```", ex)
    assert v.reward == 0.0, (program, v.detail)


@needs_sandbox
def test_the_programs_own_generators_still_end_iterations(clean_machine):
    """The fix does not break iteration: a program's generator ends the tests' for, list, map and zip as usual."""
    tests = ("assert list(f(3)) == [0, 1, 2]\nassert all(map(lambda a: a < 3, f(3)))\n"
             "assert [a + b for a, b in zip(f(3), f(5))] == [0, 2, 4]\nit = iter(f(1))\nassert next(it) == 0\n"
             "assert next(it, 'end') == 'end'\n")
    v = cv.code_verifier("```python\ndef f(n):\n    yield from range(n)\n```",
                         Example(prompt="p", answer=tests, meta={"timeout": 10}))
    assert v.reward == 1.0, v.detail


# ------------------------------------------------------------------------------ issue 57: site's builtins
# The harness runs with -S, so `site` never added exit, quit, help, copyright, credits, license to its builtins,
# and a program's own `exit = lambda *a: None` was bound into the tests' namespace: a wrong program scored 1.0
# against tests that call `exit(1)` on failure.

EXITS_ON_FAILURE = "if f(1) != 2:\n    exit(1)\nif f(5) != 6:\n    quit(1)\n"


@needs_sandbox
def test_a_program_cannot_forge_a_pass_by_shadowing_exit(clean_machine):
    ex = Example(prompt="p", answer=EXITS_ON_FAILURE, meta={"timeout": 10})
    forged = cv.code_verifier("```python\nexit = quit = lambda *a: None\ndef f(x):\n    return 0\n```", ex)
    assert forged.reward == 0.0 and "SystemExit: 1" in forged.detail, forged.detail  # before: 1.0
    right = cv.code_verifier("```python\nexit = quit = lambda *a: None\ndef f(x):\n    return x + 1\n```", ex)
    assert right.reward == 1.0, right.detail  # the same tests pass a right program, shadowing or not


@needs_sandbox
@pytest.mark.parametrize("name", cv.SITE_BUILTINS)
def test_sites_builtins_stay_builtins_in_the_tests(clean_machine, name):
    """Each name `site` adds is the interpreter's own object in the tests, whatever the program binds to it."""
    program = f"{name} = lambda *a: None\ndef f(x):\n    return x + 1\n"
    tests = f"assert f(1) == 2\nassert type({name}).__module__ == '_sitebuiltins', type({name})\n"
    r = cv.run_sandboxed(program, SURE, tests=tests)
    assert r.passed, r.detail + r.stderr


# ------------------------------------------------------------------------------ issue 57: tests that cannot fail
# Tests that can never fail rewarded every program with a code block 1.0. They are refused when the data loads
# (file, row, field and reason named), and the verifier gives them no reward either.

CANNOT_FAIL = {
    "constant": "42",
    "pass": "pass",
    "assert_a_constant": "assert True, f(1)",
    "check_never_called": "def check(candidate):\n    assert candidate(1) == 2\n",
    "under_main": "def check(candidate):\n    assert candidate(1) == 2\nif __name__ == '__main__':\n    check(f)\n",
    "lambda_never_called": "g = lambda: f(1) == 2\n",
    "reads_nothing_of_the_program": "import math\nx = 2\nassert math.sqrt(x * x) == x\nprint('ok')\n",
}
CAN_FAIL = {
    "assert": "assert f(1) == 2\n",
    "check_called": "def check(candidate):\n    assert candidate(1) == 2\ncheck(f)\n",
    "parameter_named_like_the_program": "def check(f):\n    assert f(1) == 2\ncheck(f)\n",
    "exit_on_failure": EXITS_ON_FAILURE,
    "else_of_main": "if __name__ == '__main__':\n    pass\nelse:\n    assert f(1) == 2\n",
    "raise": "if f(1) != 2:\n    raise ValueError('f(1)')\n",
}


def _bind_code_rows(tmp_path, rows, **data):
    """Load `rows` as a code dataset, as a run does (composer.runtime.binding.bind_task)."""
    import json
    from types import SimpleNamespace

    from components.sources.outcome_reward import OutcomeReward
    from composer.lang.spec import Data
    from composer.runtime.binding import bind_task

    path = tmp_path / "code.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = SimpleNamespace(data=Data(train=str(path), prompt_field="prompt", answer_field="tests", **data),
                           sources={"verifier": OutcomeReward(verifier="code")}, phases=[], stages=[],
                           train=SimpleNamespace(eval_samples=8, seed=0))
    return path, bind_task(spec)


@pytest.mark.parametrize("name", sorted(CANNOT_FAIL))
def test_tests_that_cannot_fail_are_refused_when_the_data_loads(tmp_path, name):
    from composer.runtime.binding import DataError

    rows = [{"prompt": "write f", "tests": "assert f(1) == 2"}, {"prompt": "write f", "tests": CANNOT_FAIL[name]}]
    with pytest.raises(DataError) as e:
        _bind_code_rows(tmp_path, rows)
    msg = str(e.value)
    assert f"{tmp_path / 'code.jsonl'}: row 2: field 'tests'" in msg, msg
    assert "cannot fail" in msg or "never read a name the program could define" in msg, msg
    _, task = _bind_code_rows(tmp_path, rows, on_bad_row="skip")
    assert [ex.row for ex in task.train] == [1] and task.skipped_rows == 1
    # and an example built otherwise (not loaded from a file) is never rewarded: no program runs at all
    v = cv.code_verifier("```python\ndef f(x):\n    return x + 1\n```", Example(prompt="p", answer=CANNOT_FAIL[name]))
    assert v.reward == 0 and not v.parsed and "check nothing" in v.detail


def test_the_rule_keeps_tests_that_can_fail(tmp_path):
    rows = [{"prompt": "write f", "tests": t} for t in CAN_FAIL.values()]
    rows.append({"prompt": "write add", "tests": "def check(candidate):\n    assert candidate(2, 3) == 5\n",
                 "entry_point": "add"})  # HumanEval: check(add) appended
    rows.append({"prompt": "write sum", "tests": "assert sum([1, 2]) == 4\n", "entry_point": "sum"})  # named as a builtin
    _, task = _bind_code_rows(tmp_path, rows)
    assert len(task.train) == len(rows) and task.skipped_rows == 0
    assert "never read" in cv.tests_problem("assert sum([1, 2]) == 4\n")  # without the entry point: the builtin


@needs_sandbox
@pytest.mark.parametrize("name", sorted(CAN_FAIL))
def test_tests_that_can_fail_do_fail_a_wrong_program(clean_machine, name):
    ex = Example(prompt="p", answer=CAN_FAIL[name], meta={"timeout": 10})
    assert cv.code_verifier("```python\ndef f(x):\n    return x + 1\n```", ex).reward == 1.0
    assert cv.code_verifier("```python\ndef f(x):\n    return 0\n```", ex).reward == 0.0


# ------------------------------------------------------------------------------ issue 57: memory past RLIMIT_AS
# memfd_create let a program hold 1600 MiB under a 1 GiB RLIMIT_AS (100 files of 16 MiB, RLIMIT_FSIZE each), and
# SysV shared memory outlives a detach (1.5 GiB). Each program tries to hold twice its address-space limit and says
# how much it got; files are bounded by the sandbox's tmpfs.

HOLD = 512  # MiB, twice the limit below
MEMORY_HOLDERS = {
    "memfd": f"""
import os
held = 0
try:
    while held < {HOLD}:
        fd = os.memfd_create("x")
        os.write(fd, b"x" * (16 << 20))
        held += 16
except OSError as e:
    print(e)
print("held", held)
""",
    "sysv_shm": f"""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
held = 0
while held < {HOLD}:
    sid = libc.shmget(0, 128 << 20, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600
    if sid < 0:
        print("shmget:", ctypes.get_errno())
        break
    addr = libc.shmat(sid, None, 0)
    ctypes.memset(addr, 1, 128 << 20)
    libc.shmdt(ctypes.c_void_p(addr))  # the segment stays, outside the address space
    held += 128
print("held", held)
""",
    "tmpfs_files": f"""
held = 0
try:
    while held < {HOLD}:
        with open("/tmp/f%d" % held, "wb") as f:
            for _ in range(15):
                f.write(b"x" * (1 << 20))
                held += 1
except OSError as e:
    print(e)
print("held", held)
""",
}


@needs_sandbox
@pytest.mark.parametrize("how", sorted(MEMORY_HOLDERS))
def test_memory_outside_the_address_space_is_bounded(clean_machine, how):
    limits = replace(SURE, memory=256 << 20, tmpfs=32 << 20, timeout=30.0)
    r = cv.run_sandboxed(MEMORY_HOLDERS[how], limits)
    assert r.ok and "held" in r.stdout, r.stdout + r.stderr
    held = int(r.stdout.split("held")[-1])
    bound = {"memfd": 0, "sysv_shm": 0, "tmpfs_files": limits.tmpfs >> 20}[how]
    assert held <= bound, f"{how}: held {held} MiB outside a {limits.memory >> 20} MiB address space"
    # memory inside the address space is still there to use
    r = cv.run_sandboxed("x = bytearray(128 << 20)\nx[::4096] = b'y' * (32 << 10)\nprint(len(x) >> 20)", limits)
    assert r.ok and r.stdout.strip() == "128", r.stderr
