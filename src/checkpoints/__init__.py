"""What a checkpoint holds: how it is written and read (files), when last.ckpt is written (last), which one a
run resumes from (resume)."""
