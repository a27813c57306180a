"""What keeps a job from hanging or ending silently: the watchdog that names a frozen rank, and the handling of
Ctrl-C and SIGTERM."""
