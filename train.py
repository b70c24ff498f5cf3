"""python train.py model=transformer  (see nmt/conf/train.yaml)"""

from nmt.train import main

if __name__ == "__main__":
    main()
