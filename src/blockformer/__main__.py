import sys

try:  # a Ctrl-C while the command line's modules load is an interrupt, not a traceback
    from .cli import main
except KeyboardInterrupt:
    print("blockformer: interrupted", file=sys.stderr)
    raise SystemExit(130) from None

raise SystemExit(main())
