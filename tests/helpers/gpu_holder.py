"""A stand-in for a GPU job in kill-stale tests: holds files open and sleeps.

Roles (first argument):

- ``hold FILE...``: open the files, print ``ready pid=<pid>``, sleep until signalled.
- ``orphan FILE...``: become a child subreaper S, fork a launcher that starts a new session (as a login
  shell does) and forks the holder G, then exits. G is adopted by S from another session: an orphan.
  S reaps every descendant and exits when none is left, so nothing outlives the test.
- ``zombie-parent FILE...``: as a subreaper S, fork P; P forks Z, which exits at once; P never reaps it,
  holds the files and prints ``ready pid=<P> zombie=<Z>``.
- ``leader-exit BINARY MODE FILE...``: as a subreaper S, fork P (a long-lived parent, like a torchrun
  agent or a notebook server), which starts ``BINARY MODE FILE...`` (tests/helpers/leader_exit.c, built
  by the test): a process L whose main thread exits while a thread holding the files lives on (MODE
  ``run``: sleeping; ``d``: waiting in the kernel, state D). P never reaps L and prints
  ``ready pid=<P> leader=<L> thread=<T>`` (and ``child=<C>``, the vfork child, for ``d``).
- ``run FILE... -- ARGV``: open the files, then run ARGV with those descriptors inherited, and exit with
  its status (the tool's parent holds the files, and so does the tool).
- ``launch-rank FILE...`` / ``launch-spawn FILE...``: as a subreaper S, fork a launcher L that starts a new
  session (as a terminal or ``setsid torchrun`` does) and starts one worker W holding the files: a process
  with the environment torchrun gives a rank, or a multiprocessing ``spawn`` child. L prints
  ``ready pid=<W> launcher=<L>`` and sleeps; the test kills L to leave W without its launcher (W is then
  adopted by S). The rank, like torchrun's (``start_new_session=True`` in torch.distributed.elastic's
  SubprocessHandler), leads its own session, so only S's name shows the adoption: ``--comm tini`` makes
  S a ``tini -s`` style subreaper. The spawn child stays in L's session, which S is not in.
- ``pid1-hold FILE...`` / ``pid1-rank FILE...``: no subreaper: fork L, which starts a new session, and
  exit, so L's parent is PID 1. ``pid1-hold``: L holds the files itself (a nohup'd job whose shell is
  gone) and prints ``ready pid=<L>``. ``pid1-rank``: L starts a rank (as in ``launch-rank``) and prints
  ``ready pid=<W> launcher=<L>``; once the test kills L, PID 1 adopts the rank. Whatever PID 1 is must
  reap them.

Options: ``--fork-worker`` makes a holder (and a ``launch-rank`` rank) fork a DataLoader-style worker
that keeps its descriptors, named in the ready line as ``worker=<pid>``; ``--ignore-term`` ignores
SIGTERM; ``--comm NAME`` sets the kernel's process name (with argv[0] set by the caller, this is how a
daemon's name is worn; for ``launch-*``, the subreaper's name); ``--uid UID`` drops to that user after
opening.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import time

PR_SET_NAME = 15
PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, arg: int | bytes) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, arg, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl failed")


def _open_all(paths: list[str]) -> list[int]:
    return [os.open(p, os.O_RDONLY) for p in paths]


def _ready(**extra: int) -> None:
    fields = " ".join(f"{k}={v}" for k, v in {"pid": os.getpid(), **extra}.items())
    sys.stdout.write(f"ready {fields}\n")
    sys.stdout.flush()


def _sleep_forever() -> None:
    while True:
        signal.pause()


def _reap_until_alone() -> None:
    """What a subreaper init does: wait for every child (adopted ones too), then exit."""
    while True:
        try:
            os.wait()
        except ChildProcessError:
            os._exit(0)
        except InterruptedError:
            continue


def _apply(opts: argparse.Namespace) -> None:
    if opts.comm:
        _prctl(PR_SET_NAME, opts.comm.encode()[:15])
    if opts.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "role",
        choices=[
            "hold",
            "orphan",
            "zombie-parent",
            "leader-exit",
            "run",
            "launch-rank",
            "launch-spawn",
            "pid1-hold",
            "pid1-rank",
        ],
    )
    parser.add_argument("files", nargs="*")
    parser.add_argument("--ignore-term", action="store_true")
    parser.add_argument("--fork-worker", action="store_true")
    parser.add_argument("--comm")
    parser.add_argument("--uid", type=int)
    argv = sys.argv[1:]
    tail: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, tail = argv[:cut], argv[cut + 1 :]
    opts = parser.parse_args(argv)

    if opts.role == "hold":
        _open_all(opts.files)
        if opts.uid is not None:
            os.setgid(opts.uid)
            os.setuid(opts.uid)
        _apply(opts)
        if opts.fork_worker:  # a DataLoader-style worker: forked, not exec'd, so it keeps the descriptors
            child = os.fork()
            if child == 0:
                _sleep_forever()
            _ready(worker=child)
        else:
            _ready()
        _sleep_forever()

    if opts.role == "run":
        fds = _open_all(opts.files)
        _apply(opts)
        sys.exit(subprocess.call(tail, pass_fds=fds))

    if opts.role in ("pid1-hold", "pid1-rank"):
        if os.fork() == 0:
            os.setsid()
            if opts.role == "pid1-hold":
                _open_all(opts.files)
                _apply(opts)
                while os.getppid() != 1:
                    time.sleep(0.01)
                _ready()
            else:
                worker, _ = _start_worker("launch-rank", opts.files)
                while not _holds_all(worker, opts.files):
                    time.sleep(0.01)
                _ready(pid=worker, launcher=os.getpid())
            _sleep_forever()
        os._exit(0)

    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    if opts.role == "orphan":
        launcher = os.fork()
        if launcher == 0:
            os.setsid()
            if os.fork() == 0:
                _open_all(opts.files)
                _apply(opts)
                while os.getppid() == launcher:  # wait until adopted, so the test sees an orphan
                    time.sleep(0.01)
                _ready()
                _sleep_forever()
            os._exit(0)
        _reap_until_alone()

    if opts.role in ("launch-rank", "launch-spawn"):
        if opts.comm:  # the subreaper's own name; the worker keeps its interpreter's
            _prctl(PR_SET_NAME, opts.comm.encode()[:15])
        if os.fork() == 0:
            os.setsid()
            # L goes by the name a launcher has (torchrun's script is its command name), not S's.
            _prctl(PR_SET_NAME, b"torchrun" if opts.role == "launch-rank" else b"python")
            worker, forked = _start_worker(opts.role, opts.files, opts.fork_worker)
            while not _holds_all(worker, opts.files):
                time.sleep(0.01)
            extra = {"worker": forked} if forked is not None else {}
            _ready(pid=worker, launcher=os.getpid(), **extra)
            _sleep_forever()
        _reap_until_alone()

    if opts.role == "leader-exit":
        if os.fork() == 0:
            _apply(opts)
            binary, mode, *files = opts.files
            leader = subprocess.Popen([binary, mode, *files], stdout=subprocess.PIPE, text=True)
            assert leader.stdout is not None
            fields = dict(f.split("=") for f in leader.stdout.readline().split()[1:])
            _ready(**{k: int(v) for k, v in fields.items()})
            _sleep_forever()  # never reaps the leader: only its threads' exit could free it
        _reap_until_alone()

    if opts.role == "zombie-parent":
        if os.fork() == 0:
            _open_all(opts.files)
            _apply(opts)
            zombie = os.fork()
            if zombie == 0:
                os._exit(0)
            while _state(zombie) != "Z":
                time.sleep(0.01)
            _ready(zombie=zombie)
            _sleep_forever()
        _reap_until_alone()


# What torchrun (torch.distributed.elastic's local agent) puts in a rank's environment.
RANK_ENV = {
    "TORCHELASTIC_RUN_ID": "test-run",
    "TORCHELASTIC_RESTART_COUNT": "0",
    "GROUP_RANK": "0",
    "LOCAL_RANK": "0",
    "RANK": "0",
    "WORLD_SIZE": "1",
    "LOCAL_WORLD_SIZE": "1",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
}


def _start_worker(role: str, files: list[str], fork_worker: bool = False) -> tuple[int, int | None]:
    """Start the worker; returns its pid and, with ``fork_worker``, the pid of the child it forked."""
    if role == "launch-rank":
        env = {**os.environ, **RANK_ENV}
        extra = ["--fork-worker"] if fork_worker else []
        rank = subprocess.Popen(
            [sys.executable, __file__, "hold", *files, *extra],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,  # as torch.distributed.elastic's SubprocessHandler does
        )
        assert rank.stdout is not None
        fields = dict(f.split("=") for f in rank.stdout.readline().split()[1:])
        return rank.pid, int(fields["worker"]) if "worker" in fields else None
    import multiprocessing

    child = multiprocessing.get_context("spawn").Process(target=_hold_in_worker, args=(files,))
    child.start()
    assert child.pid is not None
    return child.pid, None


def _hold_in_worker(files: list[str]) -> None:
    _open_all(files)
    _sleep_forever()


def _holds_all(pid: int, files: list[str]) -> bool:
    fd_dir = f"/proc/{pid}/fd"
    try:
        targets = {os.readlink(os.path.join(fd_dir, fd)) for fd in os.listdir(fd_dir)}
    except OSError:
        return False
    return all(os.path.realpath(f) in targets for f in files)


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


if __name__ == "__main__":
    main()
