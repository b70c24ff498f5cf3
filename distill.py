"""python distill.py distill.teacher=<ckpt> data=<its corpus> model=<student>  (see nmt/conf/distill.yaml)"""

from nmt.distill import main

if __name__ == "__main__":
    main()
