"""python evaluate.py ckpts=[...] | data=<name> hyps={name: file}  (see nmt/conf/evaluate.yaml)"""

from nmt.evaluate import main

if __name__ == "__main__":
    main()
