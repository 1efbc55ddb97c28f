/* A process whose main thread has exited while another thread lives on holding files: what kill-stale
 * sees as a "zombie" that still holds /dev/nvidia*. The kernel keeps an exited thread-group leader as a
 * zombie until its last thread exits (torvalds/linux kernel/exit.c, release_task), and its files stay
 * open, held by the live threads.
 *
 * Usage: leader_exit MODE FILE...
 *   MODE "run": the thread sleeps (state S).
 *   MODE "d":   the thread calls vfork() and the child sleeps, so the thread waits in the kernel for the
 *               child (wait_for_vfork_done: a killable uninterruptible sleep, shown as state D), as a
 *               thread stuck in the driver would be.
 * Prints "ready leader=<pid> thread=<tid> [child=<pid>]" once the main thread is about to exit.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

static int argc_g;
static char **argv_g;
static volatile pid_t thread_tid;
static volatile pid_t vfork_child;
static int fds[64];
static int nfds;

static void *holder(void *unused) {
    (void)unused;
    for (int i = 2; i < argc_g && nfds < 64; i++) {
        int fd = open(argv_g[i], O_RDONLY);
        if (fd < 0) { perror(argv_g[i]); _exit(2); }
        fds[nfds++] = fd;
    }
    thread_tid = (pid_t)syscall(SYS_gettid);
    if (strcmp(argv_g[1], "d") == 0) {
        pid_t child = vfork();
        if (child == 0) {
            /* The child got a copy of the descriptor table: drop it, so only the thread holds the files. */
            for (int i = 0; i < nfds; i++) close(fds[i]);
            vfork_child = getpid();
            for (;;) pause();
        }
    }
    for (;;) pause();
    return NULL;
}

int main(int argc, char **argv) {
    if (argc < 3) { fprintf(stderr, "usage: leader_exit run|d FILE...\n"); return 2; }
    argc_g = argc;
    argv_g = argv;
    pthread_t t;
    if (pthread_create(&t, NULL, holder, NULL) != 0) return 2;
    while (thread_tid == 0 || (strcmp(argv[1], "d") == 0 && vfork_child == 0)) usleep(1000);
    if (vfork_child)
        printf("ready leader=%d thread=%d child=%d\n", (int)getpid(), (int)thread_tid, (int)vfork_child);
    else
        printf("ready leader=%d thread=%d\n", (int)getpid(), (int)thread_tid);
    fflush(stdout);
    pthread_exit(NULL);
}
