"""The teacher service: the proxy in front of its workers (``server``, ``proxy``), N replicas behind it
(``replicas``), its command line (``cli``: ``launch/teacher_server.py``) and a service the run starts itself on
loopback (``local``). Its backends are :mod:``megatron_gkd.teacher.backends``.
"""
