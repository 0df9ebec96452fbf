"""The attacks every sandbox must survive, as programs: `tests/unit/test_sandbox.py` runs each and checks
the host afterwards, and `benchmarks/sandbox.py` prints the table of what each run ended with.

Each attack is (name, program, limits override). `{secret_file}` and `{port}` are filled in by the caller: a
file in the host's working directory and a port a host process listens on.
"""

from __future__ import annotations

ENV_SECRET = "COEVO_SANDBOX_CANARY"  # set in the host's environment; the sandbox must not see it
MARKER = "31337"  # the argument of the sleep a surviving child would run: found in no process afterwards

ATTACKS: dict[str, str] = {
    "infinite loop": "while True:\n    pass\n",
    "sleep past the wall clock": "import time\ntime.sleep(600)\n",
    "fork bomb": "import os\nwhile True:\n    os.fork()\n",
    "10 GB allocation": "x = bytearray(10 * 1024 ** 3)\nprint(len(x))\n",
    "write outside its tmpfs": (
        "import os\n"
        "for path in ('/usr/coevo-escape', '/coevo-escape', '/etc/coevo-escape', '/proc/1/root/coevo-escape'):\n"
        "    try:\n"
        "        open(path, 'w').write('x')\n"
        "        print('WROTE', path)\n"
        "    except OSError as e:\n"
        "        print('refused', path, type(e).__name__)\n"
        "raise SystemExit(1 if True else 0)\n"
    ),
    "read the host's environment, home and workdir": (
        "import os\n"
        f"print('ENV', os.environ.get('{ENV_SECRET}'))\n"
        "for path in ('/root', {home!r}, {secret_file!r}):\n"
        "    try:\n"
        "        print('READ', path, open(path).read() if os.path.isfile(path) else os.listdir(path))\n"
        "    except OSError as e:\n"
        "        print('refused', path, type(e).__name__)\n"
        "raise SystemExit(1)\n"
    ),
    "network connect": (
        "import socket\n"
        "for host, port in (('127.0.0.1', {port}), ('1.1.1.1', 53)):\n"
        "    try:\n"
        "        socket.create_connection((host, port), timeout=2).close()\n"
        "        print('CONNECTED', host, port)\n"
        "    except OSError as e:\n"
        "        print('refused', host, port, type(e).__name__)\n"
        "raise SystemExit(1)\n"
    ),
    "a child that outlives the run": (
        "import os, subprocess\n"
        f"subprocess.Popen(['sleep', '{MARKER}'], start_new_session=True, stdout=subprocess.DEVNULL,\n"
        "                 stderr=subprocess.DEVNULL)\n"
        "print('parent exits')\n"
        "os._exit(3)\n"
    ),
    "100 MB of output": "import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(100):\n    sys.stdout.write(chunk)\n",
}


def render(program: str, secret_file: str, home: str, port: int) -> str:
    return program.replace("{secret_file!r}", repr(secret_file)).replace("{home!r}", repr(home)).replace(
        "{port}", str(port))
