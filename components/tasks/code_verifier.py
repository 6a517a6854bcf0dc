"""`verifier: code`: run the response's program against the example's tests in a sandbox.

Convention for the data
  * the program: the last ```python (or ```py / ```python3) fenced block of the response, else the
    last unlabelled ``` block, else the whole response when it compiles as Python. A response with
    no code (empty, or prose that is not Python) gives `Verdict(0, parsed=False)`.
  * the tests: `example.meta["tests"]` (a string, or a list of strings joined by newlines) when
    present, else `example.answer`. Tests are Python source (asserts, or a `def check(candidate)`;
    with `example.meta["entry_point"]` set and a `check` defined, `check(<entry_point>)` is
    appended, as in HumanEval). An example without tests gives `Verdict(0, parsed=False)`: a
    program with nothing to check is never rewarded. Nor are tests that cannot fail: they must run,
    at their top level, an `assert` of a non-constant, a `raise` or a call, and read a name the
    program could define (not only their own names, builtins and standard-library modules); code
    under `if __name__ == "__main__":` and a function never called count as absent. Such rows are
    refused when the data loads (`code_answer_problem`, `tests_problem`).
  * `example.meta["timeout"]` (seconds, a number in (0, MAX_CODE_TIMEOUT]) overrides the wall-clock
    limit for one example; anything else is refused when the data loads.

A pass is something the program cannot produce. The program and the tests run in two processes:
  * the program process imports the program (as module `solution`, so `if __name__ == "__main__"`
    blocks do not run) and then only answers requests: call this function, get this attribute,
    iterate this object;
  * the test harness (the sandbox's PID 1) runs the tests in its own interpreter, with every
    top-level name of the program bound to a proxy of it, except names the tests would otherwise
    resolve elsewhere: a builtin (`abs`, `len`, `sorted`, `isinstance`..., and `site`'s `exit`, `quit`,
    `help`, `copyright`, `credits`, `license`, added to the harness's -S interpreter) stays the builtin and a
    standard-library module name is the harness's own import (a program defining `def abs(x): return 0`
    cannot change what the tests compute; only `meta["entry_point"]` may take such a name). Values cross between the two as plain
    data (numbers, strings, bytes, lists, tuples, dicts, sets, None) rebuilt by the harness, or as
    handles to the program's other objects, so a program's `__eq__` never decides a comparison.
    The tests are compiled with asserts on whatever the interpreter's flags. A test that hands the
    program a function or object of its own fails (it cannot cross).
  * success is one line the harness writes after the last test, carrying a secret nonce, on a pipe
    only the harness holds. The program never sees the tests, the nonce or that pipe: it runs
    without any capability, and the harness is not dumpable, so the program cannot read its memory
    or file descriptors (ptrace, /proc/1/mem, /proc/1/fd). Exit statuses are not trusted at all:
    `raise SystemExit(0)`, `os._exit(0)`, an excepthook, atexit, or re-executing with `python -O`
    before the tests all score 0.

Isolation (Linux): inside `unshare --user --map-root-user --net --pid --fork --kill-child --mount
--mount-proc --ipc --uts` (as `nobody`, uid 65534, when started by root):
  * a new network namespace (only a downed loopback): no traffic leaves, not even to 127.0.0.1;
  * a new PID namespace: the program cannot see or signal processes outside it; when its init dies
    the kernel kills everything left in it;
  * a user namespace mapped onto one unprivileged uid, so RLIMIT_NPROC is enforced, and the
    program's process drops every capability (bounding set, securebits locked, no_new_privs);
  * a filesystem view with only what the interpreter needs, read-only: a new root (tmpfs) holding
    read-only binds of /usr, /lib*, /bin, /sbin and the interpreter's own prefix, /dev/null, zero,
    full, random and urandom, a fresh /proc, and a size-limited tmpfs /tmp holding the working
    directory. The host's /etc, /home, /root, /work, the project checkout and datasets are not in it;
  * rlimits: CPU seconds, address space, file size, processes, open files, no core dumps;
  * a seccomp filter on the program's processes: the syscalls that hold memory outside an address
    space (memfd_create, memfd_secret, SysV shmget / msgget / semget, mq_open) fail with EPERM;
  * an empty environment, stdin /dev/null, its own session; on timeout the session and the
    namespace's init are SIGKILLed.
Fail closed: when `unshare`, user/net/pid/mount namespaces, the new root, or the in-sandbox checks
(outer uid not 0, no network interface but `lo`, PID 1 in a new namespace, no capability left in the
program's process, its seccomp filter in force) are not available, the verifier raises
`SandboxUnavailable` rather than run code.

Host side: a fresh temporary directory holds the program and tests and the captured output (bounded
by RLIMIT_FSIZE); it is removed afterwards.

Memory (no cgroup is used): each process's address space is at most `memory` (RLIMIT_AS), at most
`nproc` processes, and files live on the two tmpfs (`tmpfs` bytes for /tmp, 1 MiB for the root), so the
sandbox holds at most nproc x memory + tmpfs + 1 MiB, plus kernel buffers of its pipes and sockets (bounded
by its open files). What would escape this (a memfd is bounded only by RLIMIT_FSIZE, per file; SysV shared
memory outlives a detach) is refused by the seccomp filter: tests/test_sandbox.py tries both.

Imports are light: the registration is read during validation; nothing runs until called.
"""

from __future__ import annotations

import ast
import functools
import json
import math
import os
import re
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from typing import Optional

from composer.errors import MachineUnavailable
from composer.data import Example, Verdict
from composer.registry import register_verifier

SANDBOX_PREFIX = "composer-sbx-"
NOBODY = 65534
_SETUP_FAILED = 97
MAX_CODE_TIMEOUT = 300.0  # seconds: a per-row `timeout` above this is a data error


class SandboxUnavailable(MachineUnavailable):
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
    returncode: int  # without tests: the program's exit status; with tests: the harness's (not trusted)
    stdout: str
    stderr: str
    timed_out: bool
    wall: float
    workdir: str  # the working directory's name (unique per run; appears in the program's argv)
    passed: bool = False  # with tests: the harness reported, with the nonce, that every test ran through
    detail: str = ""  # with tests: the harness's reason when they did not

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


# --------------------------------------------------------------------------- inside the sandbox

# The program's process after exec (tests mode): imports the program, says which names it defines,
# then answers the harness's requests. Everything here runs next to the program and is untrusted:
# the harness rebuilds every value itself and trusts nothing this process says beyond plain data.
_SERVER = r"""
import base64, builtins, json, os, struct, sys, traceback
req, resp = int(sys.argv[1]), int(sys.argv[2])
objects = []
DATA = (type(None), bool, int, float, str)
def enc(v, depth=0):
    t = type(v)
    if t in DATA:
        if t is int and abs(v).bit_length() > 14000:
            return {"h": keep(v)}
        return v
    if depth < 100:
        if t is list: return {"l": [enc(x, depth + 1) for x in v]}
        if t is tuple: return {"t": [enc(x, depth + 1) for x in v]}
        if t is dict: return {"d": [[enc(k, depth + 1), enc(x, depth + 1)] for k, x in v.items()]}
        if t is set: return {"s": [enc(x, depth + 1) for x in v]}
        if t is frozenset: return {"f": [enc(x, depth + 1) for x in v]}
        if t is bytes: return {"b": base64.b64encode(v).decode()}
        if t is complex: return {"c": [v.real, v.imag]}
    return {"h": keep(v)}
def keep(v):
    objects.append(v)
    return len(objects) - 1
def dec(v):
    if not isinstance(v, dict): return v
    (k, x), = v.items()
    if k == "h": return objects[x]
    if k == "l": return [dec(i) for i in x]
    if k == "t": return tuple(dec(i) for i in x)
    if k == "d": return {dec(a): dec(b) for a, b in x}
    if k == "s": return {dec(i) for i in x}
    if k == "f": return frozenset(dec(i) for i in x)
    if k == "b": return base64.b64decode(x)
    if k == "c": return complex(*x)
    raise ValueError(k)
def send(obj):
    data = json.dumps(obj).encode()
    data = struct.pack(">I", len(data)) + data
    while data:
        data = data[os.write(resp, data):]
def recv():
    head = b""
    while len(head) < 4:
        c = os.read(req, 4 - len(head))
        if not c: os._exit(0)
        head += c
    n, body = struct.unpack(">I", head)[0], b""
    while len(body) < n:
        c = os.read(req, n - len(body))
        if not c: os._exit(0)
        body += c
    return json.loads(body)
ns = {"__name__": "solution", "__builtins__": builtins}
try:
    with open("main.py", "rb") as f:
        exec(compile(f.read(), "main.py", "exec", dont_inherit=True), ns)
    send({"ready": {k: enc(v) for k, v in list(ns.items()) if not (k.startswith("__") and k.endswith("__"))}})
except BaseException as e:
    traceback.print_exc()
    send({"failed": type(e).__name__ + ": " + str(e)[:500]})
    os._exit(1)
OPS = {
    "call": lambda o, a, k: o(*a, **k), "getattr": getattr, "setattr": setattr, "getitem": lambda o, k: o[k],
    "setitem": lambda o, k, v: o.__setitem__(k, v), "len": len, "iter": iter, "next": next, "bool": bool,
    "repr": repr, "str": str, "contains": lambda o, x: x in o, "isinstance": isinstance,
}
while True:
    msg = recv()
    try:
        op, args = msg["op"], [dec(a) for a in msg["args"]]
        if op == "call":
            args = [args[0], args[1], dict(args[2])]
        value = OPS[op](*args)
        try:
            out = {"ok": enc(value)}
            json.dumps(out)
        except (ValueError, TypeError, RecursionError):
            out = {"ok": {"h": keep(value)}}
        send(out)
    except StopIteration as e:  # the end of an iteration only answers `next`: anything else raising it is an error
        send({"stop": True} if msg.get("op") == "next" else {"exc": ["StopIteration", str(e)[:2000]]})
    except BaseException as e:
        send({"exc": [type(e).__name__, str(e)[:2000]]})
"""

# The sandbox's PID 1 (uid 0 in its namespaces, 65534 outside): checks the isolation, builds the
# read-only filesystem view, sets the limits, starts the program's process without capabilities,
# and then (with tests) runs them as the harness, or (without) reports the program's exit status.
_BOOTSTRAP = r"""
import base64, builtins, ctypes, json, os, platform, resource, signal, struct, sys, time, traceback
IN_CHILD = False
src_fd, status_fd = int(sys.argv[1]), int(sys.argv[2])
name = sys.argv[3]
cpu, mem, fsize, nproc, nofile, tmpfs = map(int, sys.argv[4:10])
SERVER = sys.argv[10]
def report(obj):
    os.write(status_fd, (json.dumps(obj) + "\n").encode())
def fail(msg):
    if IN_CHILD:
        raise RuntimeError(msg)
    report({"setup": "error: " + msg})
    os._exit(97)
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 8, 32, 4096, 16384
def mount(src, dst, fstype, flags, data=None):
    enc = lambda s: s.encode() if isinstance(s, str) else s
    if libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)) != 0:
        fail("mount %s: errno %d" % (dst, ctypes.get_errno()))
def keep_flags(path):
    f = os.statvfs(path).f_flag
    return (f & (MS_NOSUID | MS_NODEV | MS_NOEXEC | 1024 | 2048)) | ((1 << 21) if f & 4096 else 0)
def drop_capabilities():
    PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_CAP_AMBIENT, PR_SET_NO_NEW_PRIVS = 24, 28, 47, 38
    for cap in range(64):
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
    libc.prctl(PR_CAP_AMBIENT, 4, 0, 0, 0)  # clear all ambient capabilities
    if libc.prctl(PR_SET_SECUREBITS, 0xEF, 0, 0, 0) != 0:  # no root magic on exec, locked
        fail("cannot lock the securebits (errno %d)" % ctypes.get_errno())
    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]
    if libc.capset(ctypes.byref(Header(0x20080522, 0)), (Data * 2)()) != 0:
        fail("cannot drop capabilities (errno %d)" % ctypes.get_errno())
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    caps = {l.split(":")[0]: int(l.split()[1], 16) for l in open("/proc/self/status") if l.startswith("Cap")}
    if any(caps.get(k, 1) for k in ("CapEff", "CapPrm", "CapBnd", "CapAmb")):
        fail("capabilities left after dropping them: %r" % caps)
# Memory a process can hold outside its address space (so past RLIMIT_AS): memfd files, SysV shared memory,
# message queues and semaphores (they outlive a detach), POSIX message queues. Syscall numbers per architecture:
# memfd_create, memfd_secret, shmget, msgget, semget, mq_open.
GENERIC = (279, 447, 194, 186, 190, 180)
SECCOMP_ARCH = {"x86_64": (0xC000003E, (319, 447, 29, 68, 64, 240)), "aarch64": (0xC00000B7, GENERIC),
                "riscv64": (0xC00000F3, GENERIC)}
def deny_memory_outside_the_address_space():
    # A seccomp filter (needs no_new_privs, set by drop_capabilities): those syscalls fail with EPERM, any
    # syscall of another ABI (x32, 32-bit) kills the process. Inherited by every child, kept across exec.
    arch = SECCOMP_ARCH.get(platform.machine())
    if arch is None:
        fail("seccomp: unknown architecture %s" % platform.machine())
    audit, nrs = arch
    LD, JEQ, JGE, RET = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_RET|K
    ALLOW, EPERM, KILL = 0x7FFF0000, 0x00050001, 0x80000000
    n = len(nrs)
    code = [(LD, 0, 0, 4), (JEQ, 1, 0, audit), (RET, 0, 0, KILL), (LD, 0, 0, 0), (JGE, n + 1, 0, 0x40000000)]
    code += [(JEQ, n - i, 0, nr) for i, nr in enumerate(nrs)] + [(RET, 0, 0, ALLOW), (RET, 0, 0, EPERM)]
    class Insn(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]
    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Insn))]
    insns = (Insn * len(code))(*[Insn(*c) for c in code])
    prog = Prog(len(code), insns)
    if libc.prctl(22, 2, ctypes.byref(prog), 0, 0) != 0:  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        fail("cannot install the seccomp filter (errno %d)" % ctypes.get_errno())
    if "Seccomp:\t2" not in open("/proc/self/status").read():
        fail("the seccomp filter is not in force")
try:
    if os.getpid() != 1:
        fail("not PID 1 of a new PID namespace")
    m = open("/proc/self/uid_map").read().split()
    if len(m) != 3 or m[1] == "0":
        fail("the sandbox maps to host uid 0 (%r)" % " ".join(m))
    ifaces = {l.split(":")[0].strip() for l in open("/proc/self/net/dev").read().splitlines()[2:] if ":" in l}
    if ifaces - {"lo"}:
        fail("network interfaces visible in the sandbox: %s" % ", ".join(sorted(ifaces)))
    payload = b""
    while True:
        chunk = os.read(src_fd, 1 << 16)
        if not chunk:
            break
        payload += chunk
    os.close(src_fd)
    job = json.loads(payload)
    # every mount read-only first (binds copy that), then a new root with only what the interpreter needs
    for line in open("/proc/self/mountinfo").read().splitlines():
        f = line.split()
        mp = f[4].encode().decode("unicode_escape")
        if mp in ("/proc", "/sys", "/dev") or mp.startswith(("/proc/", "/sys/", "/dev/")):
            continue
        FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": 1024,
                 "nodiratime": 2048, "relatime": 1 << 21}
        keep = sum(FLAGS.get(o, 0) for o in f[5].split(","))
        libc.mount(None, mp.encode(), None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep, None)  # best effort
    root = "/tmp"
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=0755")
    wanted = ["/usr", "/lib", "/lib64", "/lib32", "/libx32", "/bin", "/sbin", sys.base_prefix, sys.base_exec_prefix,
              os.path.dirname(os.path.realpath(sys.executable))]
    done = []
    while wanted:
        p = os.path.normpath(wanted.pop(0))
        if not os.path.lexists(p) or any(p == d or p.startswith(d.rstrip("/") + "/") for d in done):
            continue
        done.append(p)
        target = root + p
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if os.path.islink(p):
            os.symlink(os.readlink(p), target)
            wanted.append(os.path.realpath(p))
            continue
        os.makedirs(target, exist_ok=True)
        mount(p, target, None, MS_BIND | MS_REC)
        libc.mount(None, target.encode(), None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep_flags(target), None)
        if not os.statvfs(target).f_flag & 1:
            fail("cannot bind %s read-only" % p)
    os.makedirs(root + "/dev")
    for dev in ("null", "zero", "full", "random", "urandom"):
        open(root + "/dev/" + dev, "w").close()
        mount("/dev/" + dev, root + "/dev/" + dev, None, MS_BIND)
    os.makedirs(root + "/proc")
    mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.makedirs(root + "/tmp")
    mount("tmpfs", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=%d,nr_inodes=4096,mode=1777" % tmpfs)
    SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}.get(platform.machine())
    if SYS_PIVOT_ROOT is None:
        fail("pivot_root: unknown architecture %s" % platform.machine())
    os.chdir(root)
    if libc.syscall(SYS_PIVOT_ROOT, b".", b".") != 0:
        fail("pivot_root: errno %d" % ctypes.get_errno())
    if libc.umount2(b".", 2) != 0:  # MNT_DETACH the old root stacked on the new one
        fail("cannot detach the host's filesystem (errno %d)" % ctypes.get_errno())
    os.chdir("/")
    mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    if os.path.exists("/etc/passwd"):
        fail("the host's filesystem is still visible")
    work = "/tmp/" + name
    os.mkdir(work, 0o700)
    with open(work + "/main.py", "wb") as fh:
        fh.write(job["program"].encode("utf-8", "surrogatepass"))
    R = resource
    R.setrlimit(R.RLIMIT_CORE, (0, 0))
    R.setrlimit(R.RLIMIT_CPU, (cpu, cpu + 1))
    R.setrlimit(R.RLIMIT_AS, (mem, mem))
    R.setrlimit(R.RLIMIT_FSIZE, (fsize, fsize))
    R.setrlimit(R.RLIMIT_NPROC, (nproc, nproc))
    R.setrlimit(R.RLIMIT_NOFILE, (nofile, nofile))
    libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: the program cannot read this process (memory, fds)
    req_r, req_w = os.pipe()
    resp_r, resp_w = os.pipe()
    check_r, check_w = os.pipe()  # O_CLOEXEC: closes unread when the program's exec succeeds
    pid = os.fork()
    if pid == 0:
        IN_CHILD = True
        try:
            for fd in (status_fd, req_w, resp_r, check_r):
                os.close(fd)
            os.setsid()
            drop_capabilities()
            deny_memory_outside_the_address_space()
            os.chdir(work)
            if job["tests"] is None:
                argv = [sys.executable, "-I", work + "/main.py"]
            else:
                os.set_inheritable(req_r, True)
                os.set_inheritable(resp_w, True)
                argv = [sys.executable, "-I", "-u", "-c", SERVER, str(req_r), str(resp_w)]  # -u: prints survive the kill
            os.execve(sys.executable, argv, {})
        except SystemExit:
            pass
        except BaseException as e:
            os.write(check_w, ("%s: %s" % (type(e).__name__, e)).encode())
        os._exit(97)
    os.close(req_r)
    os.close(resp_w)
    os.close(check_w)
    why = b""
    while chunk := os.read(check_r, 4096):
        why += chunk
    if why:
        os.kill(pid, 9)
        fail("the program's process could not be started: " + why.decode("utf-8", "replace"))
    drop_capabilities()
    libc.prctl(4, 0, 0, 0, 0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
except SystemExit:
    raise
except BaseException as e:
    fail("%s: %s" % (type(e).__name__, e))
report({"setup": "ok"})
def status_of(wait_status):
    return os.waitstatus_to_exitcode(wait_status)
if job["tests"] is None:
    _, st = os.waitpid(pid, 0)
    report({"exit": status_of(st)})
    os._exit(0)

# ---- the test harness: the tests run here; the program is reached only through requests ----
class ProgramError(Exception):
    pass
class ProgramGone(BaseException):
    pass
def send(obj):
    data = json.dumps(obj).encode()
    data = struct.pack(">I", len(data)) + data
    while data:
        data = data[os.write(req_w, data):]
def read_exact(n):
    out = b""
    while len(out) < n:
        c = os.read(resp_r, min(n - len(out), 1 << 20))
        if not c:
            raise ProgramGone("the program's process ended")
        out += c
    return out
def recv():
    n = struct.unpack(">I", read_exact(4))[0]
    if n > (64 << 20):
        raise ProgramGone("the program's process sent %d bytes at once" % n)
    return json.loads(read_exact(n))
class Remote:
    __slots__ = ("_h",)
    def __init__(self, h):
        object.__setattr__(self, "_h", h)
    def __getattr__(self, name):
        return rpc("getattr", self, name)
    def __setattr__(self, name, value):
        rpc("setattr", self, name, value)
    def __call__(self, *args, **kwargs):
        return rpc("call", self, list(args), kwargs)
    def __getitem__(self, key):
        return rpc("getitem", self, key)
    def __setitem__(self, key, value):
        rpc("setitem", self, key, value)
    def __len__(self):
        n = rpc("len", self)
        if type(n) is not int:
            raise TypeError("len() of a program object is not an int")
        return n
    def __iter__(self):
        it = rpc("iter", self)
        return it if isinstance(it, Remote) else iter(it)
    def __next__(self):
        return rpc("next", self)
    def __contains__(self, item):
        return rpc("contains", self, item) is True
    def __bool__(self):
        return rpc("bool", self) is True
    def __repr__(self):
        r = rpc("repr", self)
        return r if type(r) is str else "<program object>"
    def __str__(self):
        r = rpc("str", self)
        return r if type(r) is str else "<program object>"
    def __eq__(self, other):  # identity only: a program's __eq__ never decides a comparison
        return isinstance(other, Remote) and other._h == self._h
    def __ne__(self, other):
        return not self.__eq__(other)
    def __hash__(self):
        return hash(("remote", self._h))
    def __instancecheck__(self, instance):
        return rpc("isinstance", instance, self) is True
def enc(v, depth=0):
    t = type(v)
    if isinstance(v, Remote):
        return {"h": v._h}
    if depth > 100:
        raise TypeError("a value nested too deeply to pass to the program")
    if t in (type(None), bool, int, float, str):
        return v
    if t is list: return {"l": [enc(x, depth + 1) for x in v]}
    if t is tuple: return {"t": [enc(x, depth + 1) for x in v]}
    if t is dict: return {"d": [[enc(k, depth + 1), enc(x, depth + 1)] for k, x in v.items()]}
    if t is set: return {"s": [enc(x, depth + 1) for x in v]}
    if t is frozenset: return {"f": [enc(x, depth + 1) for x in v]}
    if t is bytes: return {"b": base64.b64encode(v).decode()}
    if t is complex: return {"c": [v.real, v.imag]}
    raise TypeError("a test cannot pass %s to the program (plain data and the program's own objects only)"
                    % t.__name__)
def dec(v, depth=0):
    if depth > 200:
        raise ProgramGone("the program sent a value nested too deeply")
    t = type(v)
    if t in (type(None), bool, int, float, str):
        return v
    if t is not dict or len(v) != 1:
        raise ProgramGone("the program sent a malformed value")
    (k, x), = v.items()
    if k == "h" and type(x) is int: return Remote(x)
    if k == "l" and type(x) is list: return [dec(i, depth + 1) for i in x]
    if k == "t" and type(x) is list: return tuple(dec(i, depth + 1) for i in x)
    if k == "d" and type(x) is list: return {dec(a, depth + 1): dec(b, depth + 1) for a, b in x}
    if k == "s" and type(x) is list: return {dec(i, depth + 1) for i in x}
    if k == "f" and type(x) is list: return frozenset(dec(i, depth + 1) for i in x)
    if k == "b" and type(x) is str: return base64.b64decode(x)
    if k == "c" and type(x) is list and len(x) == 2: return complex(float(x[0]), float(x[1]))
    raise ProgramGone("the program sent a malformed value")
def rpc(op, *args):
    send({"op": op, "args": [enc(a) for a in args]})
    msg = recv()
    if type(msg) is not dict:
        raise ProgramGone("the program sent a malformed answer")
    if "ok" in msg:
        return dec(msg["ok"])
    if "stop" in msg:
        # Only `next` may end an iteration. A StopIteration out of the program's function, attribute, len or
        # bool would end the tests' map / filter / zip (all(map(...)) of nothing is True): an error instead
        if op == "next":
            raise StopIteration
        raise ProgramError("StopIteration raised by the program (%s), not at the end of an iteration" % op)
    exc = msg.get("exc")
    if type(exc) is list and len(exc) == 2 and type(exc[0]) is str and type(exc[1]) is str:
        cls = getattr(builtins, exc[0], None)
        error = None
        if isinstance(cls, type) and issubclass(cls, Exception) and not issubclass(cls, StopIteration):
            try:
                error = cls(exc[1])
            except Exception:  # a builtin exception that wants other arguments
                pass
        raise error if error is not None else ProgramError("%s: %s" % (exc[0], exc[1]))
    raise ProgramGone("the program sent a malformed answer")
def program_status():
    for _ in range(50):  # the pipe closes a moment before the process is reaped
        try:
            done, st = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return None
        if done:
            return status_of(st)
        time.sleep(0.01)
    return None
result = {"result": "fail"}
try:
    first = recv()
    if type(first) is dict and "failed" in first:
        result["why"] = "the program failed before the tests ran: %s" % str(first["failed"])[:500]
    elif type(first) is not dict or type(first.get("ready")) is not dict:
        result["why"] = "the program's process did not start the tests"
    else:
        names = {str(k): dec(v) for k, v in first["ready"].items() if type(k) is str and k.isidentifier()}
        # What the tests call without defining it is never the program's: a builtin name (`abs`, `len`,
        # `sorted`, `isinstance`, `AssertionError`...) stays the builtin, a standard-library module name
        # (`math`, `re`) is the harness's own import. Only the declared entry point may take such a name.
        # A normal interpreter's builtins include what `site` adds (exit, quit, help...): this one runs with
        # -S, so they are added here, and they stay builtins even where `site` cannot set them up.
        SITE_BUILTINS = tuple(job["site_builtins"])
        import site
        site.setquit(), site.setcopyright(), site.sethelper()
        entry = job.get("entry")
        for k in list(names):
            if k == entry:
                continue
            if hasattr(builtins, k) or k in SITE_BUILTINS or k in ("True", "False", "None"):
                del names[k]
            elif k in sys.stdlib_module_names:
                try:
                    names[k] = __import__(k)
                except BaseException:
                    del names[k]
        tests = compile(job["tests"], "tests.py", "exec", dont_inherit=True, optimize=0)  # asserts always on
        scope = dict(names, __name__="__tests__", __builtins__=builtins)
        exec(tests, scope)
        result = {"result": "pass", "nonce": job["nonce"]}
except ProgramGone as e:
    st = program_status()
    result["why"] = "%s before the tests finished%s" % (e, "" if st is None else " (status %d)" % st)
    result["program_status"] = st
except BaseException as e:
    traceback.print_exc()
    result["why"] = "the tests failed: %s: %s" % (type(e).__name__, str(e)[:500])
try:
    os.kill(pid, 9)
except OSError:
    pass
report(result)
os._exit(0)
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


def run_sandboxed(source: str, limits: SandboxLimits = DEFAULT_LIMITS, python: Optional[str] = None,
                  tests: Optional[str] = None, entry: Optional[str] = None) -> SandboxResult:
    """Run Python `source` in the sandbox; raises SandboxUnavailable when isolation cannot be set up.

    Without `tests`: the program runs as `__main__` and `returncode` is its exit status. With `tests`:
    the program is imported in its own process and the tests run in the harness against it; `passed`
    is True only when the harness reported, with this run's nonce, that the last test ran through.
    """
    if not sys.platform.startswith("linux"):
        raise SandboxUnavailable(f"the code sandbox needs Linux namespaces; this is {sys.platform}: "
                                 "refusing to run code")
    unshare = _unshare()
    python = os.path.realpath(python or sandbox_python())
    nonce = secrets.token_hex(16)
    host = tempfile.mkdtemp(prefix=SANDBOX_PREFIX)  # 0700, root's: the sandbox never sees it
    name = os.path.basename(host)
    try:
        job_path = os.path.join(host, "job.json")
        with open(job_path, "w", encoding="utf-8", errors="surrogatepass") as f:
            json.dump({"program": source, "tests": tests, "nonce": nonce, "entry": entry,
                       "site_builtins": SITE_BUILTINS}, f)
        status_r, status_w = os.pipe()
        src_fd = os.open(job_path, os.O_RDONLY)
        out = open(os.path.join(host, "stdout"), "wb")
        err = open(os.path.join(host, "stderr"), "wb")
        cmd = [unshare, "--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child", "--mount",
               "--mount-proc", "--ipc", "--uts", python, "-I", "-S", "-c", _BOOTSTRAP, str(src_fd), str(status_w),
               name, str(int(limits.cpu)), str(int(limits.memory)), str(int(limits.fsize)), str(int(limits.nproc)),
               str(int(limits.nofile)), str(int(limits.tmpfs)), _SERVER]
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
        reports = _reports(status)
        stderr = _read_head(os.path.join(host, "stderr"), limits.output)
        setup = next((r["setup"] for r in reports if "setup" in r), None)
        if setup != "ok":
            if setup is None and timed_out:
                raise SandboxUnavailable(f"code sandbox setup did not finish within {limits.timeout:g}s: "
                                         f"{stderr.strip()}")
            why = (str(setup or "").removeprefix("error: ") or stderr.strip() or f"exit {proc.returncode}")
            raise SandboxUnavailable(f"code sandbox setup failed, refusing to run code: {why}")
        final = next((r for r in reports if "result" in r or "exit" in r), {})
        if tests is None:
            code = final.get("exit")
            returncode = code if isinstance(code, int) and not isinstance(code, bool) else (proc.returncode or -9)
        else:
            returncode = proc.returncode
        passed = tests is not None and not timed_out and final.get("result") == "pass" and \
            secrets.compare_digest(str(final.get("nonce", "")), nonce)
        detail = str(final.get("why", "")) if tests is not None and not passed else ""
        return SandboxResult(returncode=returncode, stdout=_read_head(os.path.join(host, "stdout"), limits.output),
                             stderr=stderr, timed_out=timed_out, wall=wall, workdir=name, passed=passed,
                             detail=detail)
    finally:
        shutil.rmtree(host, ignore_errors=True)


def _reports(status: bytes) -> list[dict]:
    """The JSON lines the sandbox's PID 1 wrote on its status pipe (only it holds that pipe)."""
    out = []
    for line in status.decode("utf-8", "replace").splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out


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
    """Raise SandboxUnavailable (with the reason) unless the sandbox works here; call before a run.

    Three checks: a plain program runs; a right program passes its tests; a program that exits 0
    before its tests (the simplest forgery) does not pass."""
    sure = replace(DEFAULT_LIMITS, timeout=30.0)
    r = run_sandboxed("print('ok')", sure)
    if not r.ok or r.stdout.strip() != "ok":
        raise SandboxUnavailable(f"code sandbox self-test failed (exit {r.returncode}): {r.stderr.strip()[-500:]}")
    r = run_sandboxed("def f(x):\n    return x + 1\n", sure, tests="assert f(41) == 42\n")
    if not r.passed:
        raise SandboxUnavailable(f"code sandbox self-test failed: a right program did not pass its tests "
                                 f"({r.detail}): {r.stderr.strip()[-500:]}")
    r = run_sandboxed("import os\nos._exit(0)\n", sure, tests="assert False\n")
    if r.passed:
        raise SandboxUnavailable("code sandbox self-test failed: a program that exits before its tests passed")


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



def timeout_problem(value) -> Optional[str]:
    """Why a per-row `timeout` is not usable (None when it is absent or fine)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"timeout must be a number of seconds, got {type(value).__name__} {value!r:.40}"
    if not math.isfinite(value) or not 0 < value <= MAX_CODE_TIMEOUT:
        return f"timeout must be in (0, {MAX_CODE_TIMEOUT:g}] seconds, got {value!r}"
    return None


def _limits_for(example: Example) -> SandboxLimits:
    t = example.meta.get("timeout") if example.meta else None
    why = timeout_problem(t)
    if why:
        raise ValueError(why)
    if t is None:
        return DEFAULT_LIMITS
    t = float(t)
    return replace(DEFAULT_LIMITS, timeout=t, cpu=max(1, min(DEFAULT_LIMITS.cpu, int(t + 0.999))))


def _tail(text: str, n: int = 800) -> str:
    text = text.strip()
    return text if len(text) <= n else "..." + text[-n:]


# ------------------------------------------------------------------ tests that cannot tell programs apart
# A static rule, read when the data loads (and again before a program runs): the tests must (1) run at their top
# level something that can fail, an `assert` of a non-constant, a `raise`, or a call, and (2) read a name the
# program could define. Code under `if __name__ == "__main__":` counts as absent (the harness runs the tests as
# `__tests__`), and so does a function's body: a `check()` defined but never called checks nothing. The rule is
# conservative: it refuses only tests that give every program the same result, never a test that might not.

SITE_BUILTINS = ("exit", "quit", "help", "copyright", "credits", "license")  # added by `site` (the harness: -S)


def _main_guard(test: ast.expr) -> str | None:
    """'==' for `__name__ == "__main__"` (either way round), '!=' for its negation, else None."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], (ast.Eq, ast.NotEq))):
        return None
    sides = {type(x).__name__ + ":" + str(getattr(x, "id", getattr(x, "value", ""))) for x in (test.left, *test.comparators)}
    if sides != {"Name:__name__", "Constant:__main__"}:
        return None
    return "==" if isinstance(test.ops[0], ast.Eq) else "!="


class _DropMainBlocks(ast.NodeTransformer):
    """Removes the branch of an `if __name__ == "__main__":` that only runs as `__main__` (never in the harness)."""

    def visit_If(self, node: ast.If):
        self.generic_visit(node)
        guard = _main_guard(node.test)
        if guard is None:
            return node
        return (node.orelse if guard == "==" else node.body) or ast.Pass()


def _blocks(stmt: ast.stmt) -> list[list[ast.stmt]]:
    """The statement lists a statement runs itself (a class body does, a function body only when called)."""
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return []
    out = [getattr(stmt, f) for f in ("body", "orelse", "finalbody") if isinstance(getattr(stmt, f, None), list)]
    return out + [h.body for h in getattr(stmt, "handlers", [])] + [c.body for c in getattr(stmt, "cases", [])]


def _calls(stmt: ast.stmt) -> bool:
    """Does the statement itself (not its nested statements or lambdas) call something?"""
    todo = list(ast.iter_child_nodes(stmt))
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Call):
            return True
        if not isinstance(node, (ast.stmt, ast.Lambda, ast.excepthandler)):
            todo.extend(ast.iter_child_nodes(node))
    return False


def _can_fail(stmts: list[ast.stmt]) -> bool:
    """Does one of these statements, or one in a block they run, assert a non-constant, raise, or call?"""
    for s in stmts:
        if isinstance(s, ast.Assert):
            if not isinstance(s.test, ast.Constant):
                return True
        elif isinstance(s, ast.Raise) or _calls(s):
            return True
        if any(_can_fail(b) for b in _blocks(s)):
            return True
    return False


def _module_bindings(tree: ast.Module) -> set[str]:
    """Names the tests bind at module level (not inside functions, classes, lambdas or comprehensions)."""
    out, todo = set(), list(tree.body)
    scopes = (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
            continue
        if isinstance(node, scopes):
            continue
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, ast.alias):
            out.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.ExceptHandler) and node.name:
            out.add(node.name)
        todo.extend(ast.iter_child_nodes(node))
    return out


def _program_names(tree: ast.Module, entry: str | None) -> set[str]:
    """Names the tests read that the harness would take from the program (as it filters them: not a builtin,
    not a standard-library module, not True/False/None or a dunder; the entry point always)."""
    import builtins

    read = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    theirs = _module_bindings(tree)
    return {k for k in read - theirs if k == entry or not (
        hasattr(builtins, k) or k in SITE_BUILTINS or k in sys.stdlib_module_names or k.startswith("__"))}


@functools.lru_cache(maxsize=256)
def tests_problem(tests: str, entry: str | None = None) -> str | None:
    """Why these tests would give every program the same result (the rule above), or None when they can fail."""
    try:
        tree = _DropMainBlocks().visit(ast.parse(tests))
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return "the tests are not valid Python"
    if not _can_fail(tree.body):
        return ("the tests cannot fail: nothing at their top level asserts, raises or calls (a function defined "
                "but never called, or code under `if __name__ == \"__main__\":`, which the tests never run as, "
                "checks nothing); call the check at top level, e.g. `check(candidate)`, or set meta['entry_point']")
    if not _program_names(tree, entry):
        return ("the tests never read a name the program could define (only their own names, builtins and "
                "standard-library modules), so every program would get the same result; test the program's "
                "function, e.g. `assert f(1) == 2`")
    return None


def code_answer_problem(ex: Example) -> Optional[str]:
    """Why a row cannot be verified as code (its timeout, no tests, tests that do not compile or cannot tell
    programs apart), or None."""
    why = timeout_problem((ex.meta or {}).get("timeout"))
    if why:
        return why
    tests = example_tests(ex)
    if not tests.strip():
        return "no tests (the answer or meta['tests'] holds the test code)"
    if not _compiles(tests):
        return "the tests are not valid Python"
    return tests_problem(tests, _entry(ex))


def _entry(example: Example) -> str | None:
    """The row's declared entry point (meta['entry_point']), as the harness gets it."""
    entry = example.meta.get("entry_point") if example.meta else None
    return str(entry) if entry else None


STOPPED = {"SIGXCPU": "CPU time limit", "SIGKILL": "killed (CPU or time limit)", "SIGXFSZ": "file size limit"}


@register_verifier("code", "Imports the response's last ```python block in a sandbox (no network, read-only "
                           "filesystem view, rlimits, PID/user/mount namespaces, no capabilities) and runs the "
                           "example's tests (answer or meta['tests']) against it from a separate harness; reward "
                           "1 iff the harness reports every test passed.",
                   check="code_answer_problem", preflight="ensure_sandbox")
def code_verifier(response: str, example: Example) -> Verdict:
    """Reward 1.0 iff the harness, running the example's tests against the imported program, reports a pass."""
    program = extract_program(response)
    if program is None:
        return Verdict(0.0, parsed=False, detail="no code found: expected a ```python fenced block")
    tests = example_tests(example)
    if not tests.strip():
        return Verdict(0.0, parsed=False, detail="the example has no tests (answer or meta['tests'])")
    why = tests_problem(tests, _entry(example))
    if why:  # refused when the data loads; here for examples built otherwise: nothing to check, no reward
        return Verdict(0.0, parsed=False, detail=f"the example's tests check nothing: {why}")
    try:
        limits = _limits_for(example)
    except ValueError as e:
        return Verdict(0.0, parsed=False, detail=f"the example's {e}")
    r = run_sandboxed(program, limits, tests=tests, entry=_entry(example))
    if r.passed:
        return Verdict(1.0)
    if r.timed_out:
        return Verdict(0.0, detail=f"timed out after {limits.timeout:g}s")
    status = next((int(x) for x in re.findall(r"status (-?\d+)", r.detail)), None)
    if status is not None and status < 0:
        sig = -status
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
        why = STOPPED.get(name, f"signal {name}")
        return Verdict(0.0, detail=f"the program was stopped: {why}. {_tail(r.stderr, 400)}".strip())
    return Verdict(0.0, detail=f"{r.detail or 'the tests did not pass'}:\n{_tail(r.stderr)}")
