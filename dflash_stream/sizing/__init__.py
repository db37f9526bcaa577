"""The run's sizes from its config: the arithmetic `plan` shows and `run` checks before it starts.

    inputs.py   the data's sample count and mean length, tune's measurements: what the sizes start from
    memory.py   the target's and the drafter's widths and parameters (one count), device memory per role,
                `startup_check` (run refuses a role that does not fit its GPU)
    disk.py     the whole disk footprint per filesystem, `check_run_disk` (run refuses when it does not fit)
    work.py     each role's rates, regeneration's cost, the split of a launch (`plan_roles`: roles.trainers auto)
    checkpoints.py  checkpoints (count, bytes, stall) and one crash's cost under each release rule (train.release)
    host_memory.py  host RAM per role and per machine for hidden states and the checkpoint snapshot,
                `check_machine` (run, extract and train warn when a machine's share exceeds its available RAM)

It sits below `observe` and `pipeline`, which both ask here; it renders nothing (`observe/plan.py` does).
"""
