"""Machinery: what the training loop stands on. Read it to learn how a run works; your own code
is config.py, data.py, model.py and optim.py above this folder, and the loop in train.py.

    engine.py      the model wrapped for training, the optimizer, one step, one validation pass
    loader.py      batches in an order that is a pure function of (seed, epoch): exact resume
    checkpoint.py  checkpoints written atomically, verified on load
    runlog.py      run.json and metrics.jsonl; the run folder's lock
    stopping.py    SIGTERM, Ctrl-C and SIGUSR1 end a run at a step, with its checkpoint
    rundir.py      --run-dir, a local folder or a store URL: opened to train, or fetched to read
    store.py       --run-dir on an object store (s3://, gs://): checkpoints uploaded, resumed anywhere
    distributed.py what differs with the number of processes: ranks, collectives, the wrapped model
    tracking.py    the mlflow run that mirrors metrics.jsonl
"""
