"""``fence_inspect``, ``fence_revoke`` and ``fence_doctor``: the ``fence`` command on the
project's lock backend (:func:`fence.adapters.django.locks.lock_url`)."""
