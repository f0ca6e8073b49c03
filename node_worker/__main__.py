from shm.threads_env import apply

apply()  # before the worker's imports load NumPy and numba; the coordinator's settings (worker_env) stay

from .proc import main  # noqa: E402

raise SystemExit(main())
