"""python translate.py ckpt=<run>/checkpoints/last.ckpt < in.txt > out.txt  (see nmt/conf/translate.yaml)"""

from nmt.cli_io import hold_stop_signals

hold_stop_signals()  # before the imports: a SIGINT or SIGTERM in the seconds they take is kept, not lost

from nmt.translate import main  # noqa: E402

if __name__ == "__main__":
    main()
