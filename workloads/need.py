"""``python -m workloads.need MOD...``: exit 0 if every module is importable, 1 otherwise.

Used by the task specs' ``setup`` so a node that already has the dependencies skips the install;
it only looks the modules up (``importlib.util.find_spec``) instead of importing them, which for
torch would cost seconds on every launch.
"""

import importlib.util
import sys


def main(modules: list[str]) -> int:
    """Returns 0 when all ``modules`` can be found, else prints the missing ones and returns 1."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        print(f"missing: {' '.join(missing)}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
