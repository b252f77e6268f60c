"""What a trainer and a teacher service say to each other: the request and answer types (``types``), their
wire format (``wire``, ``codec``: msgpack headers and raw buffers; ``zmtp``: ZMTP 3.0 read as bytes arrive), who may speak
(``security``: the shared secret, exposure checks), which model answers (``identity``) and what sampling means
(``sampling``). docs/teacher_protocol.md is the specification.
"""
