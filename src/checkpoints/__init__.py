"""What a checkpoint holds: how it is written and read (files), in an object store too (object_store), when
last.ckpt is written (last), which one a run resumes from (resume), and that a new training never writes over an
earlier run's (earlier_run)."""
