"""python -m ringreduce explain ... | sim ... | info"""
import os
import sys


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"explain": "ringreduce.explain", "sim": "ringreduce.sim",
                "info": "ringreduce.info"}
    if not argv or argv[0] not in commands:
        asked = bool(argv) and argv[0] in ("-h", "--help")
        if argv and not asked:
            print(f"python -m ringreduce: no command {argv[0]!r}", file=sys.stderr)
        print("usage: python -m ringreduce {explain,sim,info} [options]   (--help after any)\n"
              "  explain  what every rank sends, receives and holds, step by step\n"
              "  sim      bytes, steps and modelled time of ring vs other algorithms at any "
              "scale\n"
              "  info     versions, MPI, CUDA and settings here (under mpiexec: the ring "
              "too), for a bug report", file=sys.stdout if asked else sys.stderr)
        return 0 if asked else 2
    import importlib

    return run_command(importlib.import_module(commands[argv[0]]).main, argv[1:])


def run_command(main, argv=None) -> int:
    """main(argv), with what a user does to a command line tool taken as meant."""
    try:
        return main(argv)
    except BrokenPipeError:
        # Piped into `head` or `less`, which stopped reading: not an error. Python would
        # report the broken pipe again when it flushes stdout at exit, so it goes nowhere.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:  # Ctrl-C: stopped, as asked, without a traceback
        print("\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
