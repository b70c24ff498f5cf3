"""python translate.py ckpt=<run>/checkpoints/last.ckpt < in.txt > out.txt  (see nmt/conf/translate.yaml)"""

from nmt.translate import main

if __name__ == "__main__":
    main()
