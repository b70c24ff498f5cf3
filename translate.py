"""python translate.py ckpt=<run>/checkpoints/last.ckpt < in.txt > out.txt  (see nmt/conf/translate.yaml)"""

import signal

# First thing, before any import: a SIGINT or SIGTERM in the seconds the imports take is kept, not lost
held: list[int] = []
for signum in (signal.SIGINT, signal.SIGTERM):
    signal.signal(signum, lambda number, frame: held.append(number))

from nmt.cli_io import hold_stop_signals  # noqa: E402

hold_stop_signals(held)

from nmt.translate import main  # noqa: E402

if __name__ == "__main__":
    main()
