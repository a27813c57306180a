"""What keeps a job from hanging, ending silently or training on after its loss broke.

watchdog.py names a frozen rank (and has every rank write its stacks on SIGUSR2); interrupt.py handles Ctrl-C,
SIGTERM, SIGUSR1 and a SLURM job's time limit; divergence.py stops every rank at once on a NaN or diverged loss.
"""
