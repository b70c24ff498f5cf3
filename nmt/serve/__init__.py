"""An HTTP translation service: ``nmt-serve ckpt=<checkpoint or release file>`` (``nmt.serve.app``),
batching concurrent requests into shared decoding batches (``nmt.serve.batching``), and a web page
to try the model at ``/`` (``static/``)."""
