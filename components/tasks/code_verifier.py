"""`verifier: code`: run the response's program against the example's tests in a sandbox.

Convention for the data
  * the program: the last ```python (or ```py / ```python3) fenced block of the response, else the
    last unlabelled ``` block, else the whole response when it compiles as Python. A response with
    no code (empty, or prose that is not Python) gives `Verdict(0, parsed=False)`.
  * the tests: `example.meta["tests"]` (a string, or a list of strings joined by newlines) when
    present, else `example.answer`. Tests are Python source run after the program in the same
    module (asserts, or a `def check(candidate)`; with `example.meta["entry_point"]` set and a
    `check` defined, `check(<entry_point>)` is appended, as in HumanEval). An example without tests
    gives `Verdict(0, parsed=False)`: a program with nothing to check is never rewarded.
  * `example.meta["timeout"]` (seconds) overrides the wall-clock limit for one example.
  Reward 1.0 iff program + tests exit with status 0 within the limits.

Isolation (Linux): the code runs as `nobody` (uid 65534) inside `unshare --user --map-root-user
--net --pid --fork --kill-child --mount --mount-proc --ipc --uts`:
  * new network namespace (only a downed loopback): no traffic leaves, not even to 127.0.0.1;
  * new PID namespace: the program cannot see or signal processes outside it; when its init dies
    the kernel kills everything left in it; its getppid() is 0;
  * new user namespace mapped onto uid 65534, so RLIMIT_NPROC is enforced (it is not for root) and
    the sandbox has no privilege over the host's files or processes;
  * new mount namespace: fresh size-limited tmpfs over /tmp (the working directory lives there),
    /var/tmp, /dev/shm and /run (filesystem sockets), every other mount remounted read-only (best
    effort; the uid drop already denies writes to root-owned files);
  * rlimits: CPU seconds, address space, file size, processes, open files, no core dumps;
  * an empty environment, stdin /dev/null, its own session; on timeout the session and the
    namespace's init are SIGKILLed.
Fail closed: when `unshare`, user/net/pid namespaces, or the in-sandbox checks (outer uid not 0,
no network interface but `lo`, PID 1 in a new namespace) are not available, the verifier raises
`SandboxUnavailable` rather than run the code.

Host side: a fresh temporary directory holds the program and the captured output (bounded by
RLIMIT_FSIZE); it is removed afterwards. Not bounded: total memory across the sandbox's processes
is at most nproc x memory (no cgroup is used).

Imports are light: the registration is read during validation; nothing runs until called.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from typing import Optional

from composer.data import Example, Verdict
from composer.registry import register_verifier

SANDBOX_PREFIX = "composer-sbx-"
NOBODY = 65534
_SETUP_FAILED = 97


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot be set up here; code is never run without it."""


@dataclass(frozen=True)
class SandboxLimits:
    timeout: float = 10.0  # wall-clock seconds
    cpu: int = 10  # CPU seconds per process (RLIMIT_CPU)
    memory: int = 1 << 30  # address space per process, bytes (RLIMIT_AS)
    fsize: int = 16 << 20  # largest file it may write, bytes (RLIMIT_FSIZE); also caps captured output
    nproc: int = 16  # processes + threads in the sandbox (RLIMIT_NPROC)
    nofile: int = 256  # open files (RLIMIT_NOFILE)
    tmpfs: int = 64 << 20  # size of the private /tmp holding the working directory, bytes
    output: int = 64 << 10  # bytes of stdout / stderr kept in the result


DEFAULT_LIMITS = SandboxLimits()


@dataclass
class SandboxResult:
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    wall: float
    workdir: str  # the working directory's name (unique per run; appears in the program's argv)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


# --------------------------------------------------------------------------- the in-sandbox bootstrap

# Runs as PID 1 of the new namespaces (uid 0 there, 65534 outside), before the program: checks the
# isolation, builds the private filesystem view, sets the limits, reports on the status fd, execs.
_BOOTSTRAP = r"""
import ctypes, os, resource, sys
src_fd, status_fd = int(sys.argv[1]), int(sys.argv[2])
name = sys.argv[3]
cpu, mem, fsize, nproc, nofile, tmpfs = map(int, sys.argv[4:10])
def fail(msg):
    os.write(status_fd, ("error: " + msg).encode())
    os._exit(97)
try:
    if os.getpid() != 1:
        fail("not PID 1 of a new PID namespace")
    m = open("/proc/self/uid_map").read().split()
    if len(m) != 3 or m[1] == "0":
        fail("the sandbox maps to host uid 0 (%r)" % " ".join(m))
    ifaces = {l.split(":")[0].strip() for l in open("/proc/self/net/dev").read().splitlines()[2:] if ":" in l}
    if ifaces - {"lo"}:
        fail("network interfaces visible in the sandbox: %s" % ", ".join(sorted(ifaces)))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 1, 2, 4, 8, 32, 4096
    FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": 1024,
             "nodiratime": 2048, "relatime": 1 << 21}
    for line in open("/proc/self/mountinfo").read().splitlines():
        f = line.split()
        mp = f[4].encode().decode("unicode_escape")
        if mp in ("/proc", "/sys", "/dev") or mp.startswith(("/proc/", "/sys/", "/dev/")):
            continue
        keep = sum(FLAGS.get(o, 0) for o in f[5].split(","))
        libc.mount(None, mp.encode(), None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep, None)  # best effort
    for d in ("/tmp", "/var/tmp", "/dev/shm", "/run"):
        if os.path.isdir(d) and not os.path.islink(d):
            size = tmpfs if d == "/tmp" else 1 << 20
            opts = ("size=%d,nr_inodes=4096,mode=1777" % size).encode()
            if libc.mount(b"tmpfs", d.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, opts) != 0:
                fail("cannot mount a private tmpfs on %s (errno %d)" % (d, ctypes.get_errno()))
    src = b""
    while True:
        chunk = os.read(src_fd, 1 << 16)
        if not chunk:
            break
        src += chunk
    os.close(src_fd)
    work = "/tmp/" + name
    os.mkdir(work, 0o700)
    os.chdir(work)
    with open("main.py", "wb") as fh:
        fh.write(src)
    R = resource
    R.setrlimit(R.RLIMIT_CORE, (0, 0))
    R.setrlimit(R.RLIMIT_CPU, (cpu, cpu + 1))
    R.setrlimit(R.RLIMIT_AS, (mem, mem))
    R.setrlimit(R.RLIMIT_FSIZE, (fsize, fsize))
    R.setrlimit(R.RLIMIT_NPROC, (nproc, nproc))
    R.setrlimit(R.RLIMIT_NOFILE, (nofile, nofile))
except SystemExit:
    raise
except BaseException as e:
    fail("%s: %s" % (type(e).__name__, e))
os.write(status_fd, b"ok")
os.close(status_fd)
os.execve(sys.executable, [sys.executable, "-I", work + "/main.py"], {})
"""


def _unshare() -> str:
    for d in ("/usr/bin", "/bin", "/usr/sbin", "/sbin", "/usr/local/bin"):
        p = os.path.join(d, "unshare")
        if os.access(p, os.X_OK):
            return p
    raise SandboxUnavailable("`unshare` (util-linux) is not installed: refusing to run code without network, "
                             "PID and user namespaces")


def _world_executable(path: str) -> bool:
    """Can a stranger (uid 65534) reach and execute `path`?"""
    real = os.path.realpath(path)
    try:
        if not os.stat(real).st_mode & stat.S_IXOTH:
            return False
        d = os.path.dirname(real)
        while True:
            if not os.stat(d).st_mode & stat.S_IXOTH:
                return False
            if d == "/":
                return True
            d = os.path.dirname(d)
    except OSError:
        return False


def sandbox_python() -> str:
    """The interpreter the sandbox runs: this one if `nobody` can execute it, else the system python3."""
    if os.geteuid() != 0:  # the sandbox runs as this same (unprivileged) user
        return sys.executable
    candidates = [sys.executable, "/usr/bin/python3", "/usr/local/bin/python3", "/bin/python3"]
    for c in candidates:
        if c and _world_executable(c):
            return os.path.realpath(c)
    raise SandboxUnavailable(f"no Python interpreter the sandbox user (uid {NOBODY}) can execute "
                             f"(tried {', '.join(dict.fromkeys(candidates))})")


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except (OSError, ValueError):
        return []


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting for a reaper)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _read_head(path: str, n: int) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(n).decode("utf-8", "replace")
    except OSError:
        return ""


def run_sandboxed(source: str, limits: SandboxLimits = DEFAULT_LIMITS, python: Optional[str] = None) -> SandboxResult:
    """Run Python `source` in the sandbox; raises SandboxUnavailable when isolation cannot be set up."""
    if not sys.platform.startswith("linux"):
        raise SandboxUnavailable(f"the code sandbox needs Linux namespaces; this is {sys.platform}: "
                                 "refusing to run code")
    unshare = _unshare()
    python = python or sandbox_python()
    host = tempfile.mkdtemp(prefix=SANDBOX_PREFIX)  # 0700, root's: the sandbox never sees it
    name = os.path.basename(host)
    try:
        src_path = os.path.join(host, "main.py")
        with open(src_path, "w", encoding="utf-8", errors="surrogatepass") as f:
            f.write(source)
        status_r, status_w = os.pipe()
        src_fd = os.open(src_path, os.O_RDONLY)
        out = open(os.path.join(host, "stdout"), "wb")
        err = open(os.path.join(host, "stderr"), "wb")
        cmd = [unshare, "--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child", "--mount",
               "--mount-proc", "--ipc", "--uts", python, "-I", "-S", "-c", _BOOTSTRAP, str(src_fd), str(status_w),
               name, str(int(limits.cpu)), str(int(limits.memory)), str(int(limits.fsize)), str(int(limits.nproc)),
               str(int(limits.nofile)), str(int(limits.tmpfs))]
        drop = {"user": NOBODY, "group": NOBODY, "extra_groups": []} if os.geteuid() == 0 else {}
        start = time.monotonic()
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env={}, cwd="/",
                                    pass_fds=(src_fd, status_w), start_new_session=True, close_fds=True, **drop)
        except OSError as e:
            os.close(status_r)
            raise SandboxUnavailable(f"cannot start the sandbox ({unshare}): {e}") from None
        finally:
            os.close(src_fd)
            os.close(status_w)
            out.close()
            err.close()
        timed_out = False
        try:
            proc.wait(timeout=limits.timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill(proc)
        wall = time.monotonic() - start
        status = b""
        while chunk := os.read(status_r, 4096):
            status += chunk
        os.close(status_r)
        stderr = _read_head(os.path.join(host, "stderr"), limits.output)
        if status != b"ok":
            if not status and timed_out:
                raise SandboxUnavailable(f"code sandbox setup did not finish within {limits.timeout:g}s: "
                                         f"{stderr.strip()}")
            why = (status.decode("utf-8", "replace").removeprefix("error: ") or stderr.strip()
                   or f"exit {proc.returncode}")
            raise SandboxUnavailable(f"code sandbox setup failed, refusing to run code: {why}")
        return SandboxResult(returncode=proc.returncode, stdout=_read_head(os.path.join(host, "stdout"), limits.output),
                             stderr=stderr, timed_out=timed_out, wall=wall, workdir=name)
    finally:
        shutil.rmtree(host, ignore_errors=True)


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL the sandbox: its namespace init (whose death kills everything inside), then its session."""
    inits = _children(proc.pid)
    for pid in inits:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        proc.wait(timeout=1.0)  # unshare reaps its init, then exits
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    deadline = time.monotonic() + 2.0
    while inits and time.monotonic() < deadline:  # the namespace is torn down asynchronously
        inits = [p for p in inits if _alive(p)]
        if inits:
            time.sleep(0.01)


def ensure_sandbox() -> None:
    """Raise SandboxUnavailable (with the reason) unless the sandbox works here; call before a run."""
    r = run_sandboxed("print('ok')", replace(DEFAULT_LIMITS, timeout=30.0))
    if not r.ok or r.stdout.strip() != "ok":
        raise SandboxUnavailable(f"code sandbox self-test failed (exit {r.returncode}): {r.stderr.strip()[-500:]}")


# --------------------------------------------------------------------------- the verifier

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)


def _compiles(src: str) -> bool:
    try:
        compile(src, "main.py", "exec", dont_inherit=True)
        return True
    except BaseException:  # SyntaxError, ValueError (NUL bytes), RecursionError, MemoryError
        return False


def extract_program(response: str) -> Optional[str]:
    """The last ```python block, else the last unlabelled ``` block, else the whole text if it compiles."""
    blocks = _FENCE.findall(response)
    for langs in (("python", "py", "python3"), ("",)):
        found = [body for lang, body in blocks if lang.lower() in langs]
        if found and found[-1].strip():
            return found[-1]
    text = response.strip()
    if text and not blocks and _compiles(text):
        return text
    return None


def example_tests(example: Example) -> str:
    tests = example.meta.get("tests") if example.meta else None
    if tests is None:
        tests = example.answer
    if isinstance(tests, (list, tuple)):
        tests = "\n".join(map(str, tests))
    tests = str(tests or "")
    entry = example.meta.get("entry_point") if example.meta else None
    if entry and re.search(r"^def check\(", tests, re.M) and not re.search(r"^check\(", tests, re.M):
        tests += f"\n\ncheck({entry})\n"
    return tests


def _limits_for(example: Example) -> SandboxLimits:
    t = example.meta.get("timeout") if example.meta else None
    if t is None:
        return DEFAULT_LIMITS
    t = float(t)
    return replace(DEFAULT_LIMITS, timeout=t, cpu=max(1, min(DEFAULT_LIMITS.cpu, int(t + 0.999))))


def _tail(text: str, n: int = 800) -> str:
    text = text.strip()
    return text if len(text) <= n else "..." + text[-n:]


@register_verifier("code", "Runs the response's last ```python block plus the example's tests (answer or "
                           "meta['tests']) in a sandbox (no network, rlimits, PID/user/mount namespaces); "
                           "reward 1 iff exit 0.")
def code_verifier(response: str, example: Example) -> Verdict:
    """Reward 1.0 iff the extracted program followed by the example's tests exits 0 in the sandbox."""
    program = extract_program(response)
    if program is None:
        return Verdict(0.0, parsed=False, detail="no code found: expected a ```python fenced block")
    tests = example_tests(example)
    if not tests.strip():
        return Verdict(0.0, parsed=False, detail="the example has no tests (answer or meta['tests'])")
    limits = _limits_for(example)
    r = run_sandboxed(program.rstrip() + "\n\n# ---- tests ----\n" + tests.rstrip() + "\n", limits)
    if r.ok:
        return Verdict(1.0)
    if r.timed_out:
        return Verdict(0.0, detail=f"timed out after {limits.timeout:g}s")
    if r.returncode < 0:
        sig = -r.returncode
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
        why = {"SIGXCPU": "CPU time limit", "SIGKILL": "killed (CPU or time limit)",
               "SIGXFSZ": "file size limit"}.get(name, f"signal {name}")
        return Verdict(0.0, detail=f"the program was stopped: {why}. {_tail(r.stderr, 400)}".strip())
    return Verdict(0.0, detail=f"the tests failed (exit {r.returncode}):\n{_tail(r.stderr)}")
