"""Ranks forked from servers that imported torch and transformers once (zygote.py), for ranks.py: on CI's two
cores a rank's imports (2 s of CPU for torch, ~5 s with transformers' modeling code) were most of a launch's
start-up, paid by every rank of every launch. A forked rank is still its own real process over c10d Gloo,
killed and frozen by its pid.

What a forked rank could see differently from a fresh interpreter, and how each is kept apart:
- imports made before its variables were set: a server is started for each set of the variables those
  imports read (everything but the launchers', shardcast's and the tests' own: _read_after_imports), and a
  launch whose ranks differ in one starts fresh interpreters;
- one string-hash seed for every rank (Python fixes it at start): each set has two servers, and neighbouring
  ranks come from different ones, so an order of a set or dict that differs by rank can still show;
- a heap shaped by the server's imports: launches that measure memory pass fork=False;
- submodules the server imported that the product forgot to import: not kept apart; SHARDCAST_TEST_FORK=0
  starts every rank fresh.
"""
import atexit
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading

HERE = os.path.dirname(os.path.abspath(__file__))

_LAUNCHERS = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
              "MASTER_PORT"}
_TESTS_OWN = {"LAYOUTS", "SOURCES", "SOURCE", "SAVE_ROOT", "SCENARIO_VAR", "PYTEST_CURRENT_TEST"}
_OWN_PREFIXES = ("SHARDCAST_", "TEST_", "SLURM_")
FORK_VAR = "SHARDCAST_TEST_FORK"  # "0": every rank a fresh interpreter
MAX_SETS = 2  # sets of servers a process keeps (each server ~0.5 GB); the least recently used idle set goes


def _read_after_imports(key):
    """Whether no import of the server reads variable `key` (torch, transformers, huggingface_hub,
    safetensors and numpy read these only when called), so a forked rank may hold its own value."""
    return key in _LAUNCHERS or key in _TESTS_OWN or key.startswith(_OWN_PREFIXES)


def start(script, argv, envs, fork=True):
    """Starts `python script argv...` once per environment in envs (each a whole environment): forked where
    fork and the environments allow it, fresh interpreters otherwise. Returns Popen-like objects: pid,
    returncode, communicate(timeout) -> (stdout and stderr together, None), kill()."""
    servers = _servers_for(envs) if fork else None
    if servers is not None:
        ranks = []
        try:
            for i, env in enumerate(envs):
                ranks.append(servers[i % 2].spawn(script, argv, env))
            return ranks
        except _ServerGone:
            for r in ranks:  # what was forked before a server went: killed, then every rank starts afresh
                r.kill()
    return [subprocess.Popen([sys.executable, script, *argv], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True) for env in envs]


class _ServerGone(Exception):
    pass


class _Server:
    """The client of one zygote.py process: spawn() forks a rank there; a thread reads its replies. Ranks
    are known by request id, never by pid: a pid the server reaped may be another process's next."""

    def __init__(self, env):
        self.cond, self.next_id, self.pids, self.codes = threading.Condition(), 0, {}, {}
        self.ready = self.gone = False
        self.logs = tempfile.mkdtemp(prefix="shardcast-ranks-")
        self.errors = open(os.path.join(self.logs, "server"), "wb")
        read, write = os.pipe()
        self.proc = subprocess.Popen([sys.executable, os.path.join(HERE, "zygote.py"), str(write)], env=env, cwd=HERE,
                                     stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=self.errors,
                                     pass_fds=(write,))
        os.close(write)
        threading.Thread(target=self._read, args=(os.fdopen(read, "rb"),), daemon=True).start()

    def _read(self, replies):
        for line in replies:
            reply = json.loads(line)
            with self.cond:
                if "ready" in reply:
                    self.ready = True
                elif "pid" in reply:
                    self.pids[reply["id"]] = reply["pid"]
                else:
                    self.codes[reply["id"]] = reply["code"]
                self.cond.notify_all()
        with self.cond:
            self.gone = True
            self.cond.notify_all()

    def wait_ready(self, timeout):
        with self.cond:
            self.cond.wait_for(lambda: self.ready or self.gone, timeout)
            return self.ready and not self.gone

    def failure(self):
        with open(os.path.join(self.logs, "server"), errors="replace") as f:
            return f.read()[-2000:]

    def idle(self):
        with self.cond:
            return self.gone or all(rid in self.codes for rid in self.pids)

    def _send(self, message):
        try:
            self.proc.stdin.write((json.dumps(message) + "\n").encode())
            self.proc.stdin.flush()
        except (OSError, ValueError):  # its pipe closed: the server is gone
            raise _ServerGone() from None

    def spawn(self, script, argv, env):
        with self.cond:
            if self.gone:
                raise _ServerGone()
            rid, self.next_id = self.next_id, self.next_id + 1
            self._send({"id": rid, "script": script, "argv": argv, "env": env, "cwd": os.getcwd(),
                        "log": os.path.join(self.logs, str(rid))})
            if not self.cond.wait_for(lambda: rid in self.pids or self.gone, 60) or self.gone:
                raise _ServerGone()
            return _Forked(self, rid)

    def kill(self, rid):
        """SIGKILL to rank rid unless the server reaped it already (as its parent, its pid is still its own
        until then)."""
        with self.cond:
            if rid not in self.codes and not self.gone:
                try:
                    self._send({"kill": rid})
                except _ServerGone:
                    pass

    def close(self):
        """Ends the server, and with it any rank still running; its logs go."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.errors.close()
        shutil.rmtree(self.logs, ignore_errors=True)


class _Forked:
    """A rank forked by a server, as much of subprocess.Popen as ranks._launch uses."""

    def __init__(self, server, rid):
        self.server, self.rid, self.pid = server, rid, server.pids[rid]

    @property
    def returncode(self):
        with self.server.cond:
            return self.server.codes.get(self.rid)

    def communicate(self, timeout=None):
        s = self.server
        with s.cond:
            s.cond.wait_for(lambda: self.rid in s.codes or s.gone, timeout)
            done = self.rid in s.codes
        if not done:
            if s.gone:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid} (its fork server died: {s.failure()})", timeout)
            raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout)
        log = os.path.join(s.logs, str(self.rid))
        try:
            with open(log, errors="replace") as f:
                out = f.read()
            os.unlink(log)
        except FileNotFoundError:  # read already
            out = ""
        return out, None

    def kill(self):
        self.server.kill(self.rid)


_sets = collections.OrderedDict()  # the variables the imports read -> its two servers (None: could not start)


def _imports_env(env):
    return tuple(sorted((k, v) for k, v in env.items() if not _read_after_imports(k)))


def _servers_for(envs):
    """The two servers for these environments, started for the first launch that needs them; None where the
    ranks' environments differ in what the imports read, where forking is off, where every kept set is busy,
    or where they could not start (then every launch that needs them starts fresh interpreters)."""
    if os.environ.get(FORK_VAR) == "0":
        return None
    key = _imports_env(envs[0])
    if any(_imports_env(e) != key for e in envs):
        return None
    if key not in _sets:
        if len(_sets) >= MAX_SETS:
            idle = [k for k, pair in _sets.items() if pair is None or all(s.idle() for s in pair)]
            if not idle:
                return None
            for s in _sets.pop(idle[0]) or ():
                s.close()
        pair = [_Server(dict(key)) for _ in range(2)]  # two string-hash seeds (each server its own)
        if not all(s.wait_ready(300) for s in pair):
            print("forked: a fork server did not start; ranks start fresh:\n",
                  "\n".join(s.failure() for s in pair), file=sys.stderr)
            for s in pair:
                s.close()
            pair = None
        _sets[key] = pair
    _sets.move_to_end(key)
    return _sets[key]


def close_all():
    """Ends every server this process started (and any rank still running on one)."""
    while _sets:
        for s in _sets.popitem()[1] or ():
            s.close()


atexit.register(close_all)
