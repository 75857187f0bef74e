/* Runs a command and prints its peak RSS (and CPU time) to stderr when it ends:
 * "peak_rss_kib=N cpu_s=S". A benchmark written in Python cannot read a child's peak from
 * wait4: the child starts as a copy of (or sharing) the Python process, and the kernel keeps
 * that memory in the child's peak across exec, so every figure below Python's own size reads
 * as Python's size. This forks from a process of a few pages. Used by bench/data/bench.py and
 * bench/guard/guard.py (compiled with cc on the fly). */
#include <stdio.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: peakrss COMMAND [ARG...]\n");
        return 2;
    }
    pid_t pid = fork();
    if (pid < 0) {
        perror("fork");
        return 126;
    }
    if (pid == 0) {
        execvp(argv[1], argv + 1);
        perror(argv[1]);
        _exit(127);
    }
    int status;
    struct rusage ru;
    if (wait4(pid, &status, 0, &ru) < 0) {
        perror("wait4");
        return 126;
    }
    double cpu = ru.ru_utime.tv_sec + ru.ru_stime.tv_sec +
                 (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;
    fprintf(stderr, "peak_rss_kib=%ld cpu_s=%.3f\n", ru.ru_maxrss, cpu);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}
