"""A reward worker whose replies cannot be read: what a stray write into the worker's pipe looks like."""

import sys

from megatron_gkd.rewards.protocol import read_frame, write_frame

if __name__ == "__main__":
    requests, replies = sys.stdin.buffer, sys.stdout.buffer
    read_frame(requests)
    write_frame(replies, ("ready", "garbage"))
    while read_frame(requests) is not None:
        replies.write(b"a user's line on the pipe\n" * 4)
        replies.flush()
