"""``python -m hvdp doctor``, ``python -m hvdp install-horovod``, ``python -m hvdp run``
(horovodrun with elastic checks) and ``python -m hvdp trace DIR`` (the ranks' flight records)."""
import sys


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["doctor"]:
        from .doctor import main as doctor
        return doctor(argv[1:])
    if argv[:1] == ["install-horovod"]:
        from .install import main as install
        return install(argv[1:])
    if argv[:1] == ["trace"]:
        from .cluster.trace import main as trace
        return trace(argv[1:])
    if argv[:1] == ["run"]:
        from .cluster.launch import main as run
        return run(argv[1:])
    print("usage: python -m hvdp doctor | install-horovod [--help] | run <horovodrun arguments> | trace DIR",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
