"""Every rule about what a checkpoint holds when it is written and what is trusted when it is read.

- `atomic_write`: single-file checkpoints written beside the target, fsynced and renamed, with their content digest;
- `digest`: the content digest recorded on save and verified on every load (single files and sharded folders);
- `finite`: weights (and, to resume, optimizer state) that are not finite are refused;
- `read_file`: a single-file checkpoint read without running code, verified and checked;
- `read_sharded`: a sharded (torch.distributed.checkpoint) folder read without running code or leaving the folder;
- `resume_args`: resuming keeps the checkpoint's model (a contradicting flag is refused).
"""
