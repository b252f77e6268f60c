"""Teacher service entry point (the logic is :mod:`megatron_gkd.teacher.service.cli`, also ``python -m megatron_gkd.teacher.service.cli``).

    teacher_server.py serve  --frontend tcp://127.0.0.1:5555 --backend hf --model DIR   # proxy + 1 worker
    teacher_server.py proxy  --frontend tcp://0.0.0.0:5555 --workers tcp://0.0.0.0:5556 --secret-file F
    teacher_server.py worker --connect tcp://proxy-host:5556 --backend vllm --model DIR --secret-file F
    torchrun --nproc_per_node 2 teacher_server.py serve --backend megatron --model DIR \
        --backend-arg tensor_model_parallel_size=2
"""

from megatron_gkd.teacher.service.cli import main

if __name__ == "__main__":
    main()
