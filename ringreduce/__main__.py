"""python -m ringreduce explain ... | python -m ringreduce sim ..."""
import sys


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"explain": "ringreduce.explain", "sim": "ringreduce.sim"}
    if not argv or argv[0] not in commands:
        asked = bool(argv) and argv[0] in ("-h", "--help")
        print("usage: python -m ringreduce {explain,sim} [options]   (--help after either)\n"
              "  explain  what every rank sends, receives and holds, step by step\n"
              "  sim      bytes, steps and modelled time of ring vs other algorithms at any "
              "scale", file=sys.stdout if asked else sys.stderr)
        return 0 if asked else 2
    import importlib

    return importlib.import_module(commands[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
