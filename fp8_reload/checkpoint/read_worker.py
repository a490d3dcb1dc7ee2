"""A reader process (`read_procs`): positional reads of shard files into shared memory.

Run as a script (``python -I read_worker.py FD``), so it imports the standard library only,
not this package (no torch: it starts in milliseconds). FD is one end of a SOCK_SEQPACKET
socket pair; every message is one command, file descriptors travel with it (SCM_RIGHTS):

    b"M" key size   + fd   map a shared-memory file (the ring's buffers) under `key`
    b"U" key                unmap it
    b"O" key        + fd   keep an open shard under `key` (the parent's descriptor: the very
                            file it checked, whatever is renamed over its path since)
    b"C" key                close it
    b"R" req file off n mem at    read `n` bytes at `off` of file `file` into `mem` at `at`;
                            answers b"A" req errno got (errno 0 and got == n: read whole)
    b"P" req                answers b"A" req 0 0 (the parent's check that it runs)

It exits when the socket closes (the parent is gone or done with it).
"""

import mmap
import os
import signal
import socket
import struct
import sys

MAP = struct.Struct("<cQQ")
KEY = struct.Struct("<cQ")
READ = struct.Struct("<cQQQQQQ")
ANSWER = struct.Struct("<cQqQ")


def serve(sock: socket.socket) -> None:
    maps: dict[int, tuple[mmap.mmap, memoryview]] = {}
    files: dict[int, int] = {}
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(sock, 256, 2)
        except OSError:  # the parent went away mid-reload
            return
        if not msg:
            return
        op = msg[:1]
        if op == b"R":
            _, req, fkey, off, n, mkey, at = READ.unpack(msg)
            view, got, err = maps[mkey][1][at:at + n], 0, 0
            try:
                while got < n:
                    step = os.preadv(files[fkey], [view[got:]], off + got)
                    if not step:
                        break  # end of file: the parent reports the truncation
                    got += step
            except OSError as e:
                err = e.errno or -1
            view.release()
            try:
                sock.send(ANSWER.pack(b"A", req, err, got))
            except OSError:
                return
        elif op == b"M":
            _, key, size = MAP.unpack(msg)
            mem = mmap.mmap(fds[0], size)
            os.close(fds[0])
            maps[key] = (mem, memoryview(mem))
        elif op == b"U":
            mem, view = maps.pop(KEY.unpack(msg)[1], (None, None))
            if mem is not None:
                view.release()
                mem.close()
        elif op == b"O":
            files[KEY.unpack(msg)[1]] = fds[0]
        elif op == b"C" and KEY.unpack(msg)[1] in files:
            os.close(files.pop(KEY.unpack(msg)[1]))
        elif op == b"P":
            try:
                sock.send(ANSWER.pack(b"A", KEY.unpack(msg)[1], 0, 0))
            except OSError:
                return


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it closes us
    serve(socket.socket(fileno=int(sys.argv[1])))
