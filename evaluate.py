"""python evaluate.py ckpts=[...] | data=<name> hyps={name: file}  (see conf/evaluate.yaml)"""

from nmt.evaluate import main

if __name__ == "__main__":
    main()
