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
    """Live (non-zombie) processes started by a code sandbox: uid 65534 or argv naming a sandbox folder."""
    out = set()
    for p in psutil.process_iter(["uids", "cmdline", "status"]):
        try:
            if p.info["status"] == psutil.STATUS_ZOMBIE or p.pid == os.getpid():
                continue
            if (p.info["uids"] and p.info["uids"].real == cv.NOBODY) or any(
                    cv.SANDBOX_PREFIX in a for a in p.info["cmdline"] or []):
                out.add(p.pid)
        except psutil.Error:
            pass
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


def score(program: str, tests: str = "pass", timeout: float = 2.0, **meta):
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
    assert v.reward == 0 and "timed out" in v.detail
    assert time.monotonic() - t < 5


@needs_sandbox
def test_sleep_forever_in_a_detached_child(clean_machine):
    v = score("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(1000)\n"
              "time.sleep(1000)")
    assert v.reward == 0  # and clean_machine finds no orphan


@needs_sandbox
def test_fork_bomb(clean_machine):
    program = ("import os\nwhile True:\n    try:\n        if os.fork() == 0:\n            os.setsid()\n"
               "    except OSError:\n        pass")
    seen = []
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            seen.append(len(sandbox_procs()))
            time.sleep(0.05)

    w = threading.Thread(target=watch)
    w.start()
    try:
        v = score(program)
    finally:
        stop.set()
        w.join()
    assert v.reward == 0
    assert 0 < max(seen) <= cv.DEFAULT_LIMITS.nproc + 2  # RLIMIT_NPROC holds (+ unshare, + a racing sample)


@needs_sandbox
def test_memory_bomb(clean_machine):
    v = score("x = bytearray(8 << 30)")
    assert v.reward == 0 and "MemoryError" in v.detail
    v = score("chunks = []\nwhile True:\n    chunks.append(bytearray(128 << 20))")  # touches every page
    assert v.reward == 0 and ("MemoryError" in v.detail or "timed out" in v.detail)


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
