// Preloaded (LD_PRELOAD) into a child that dies with SIGSEGV on the H200 image, which has no gdb: on a fatal
// signal it prints the native stack as module+offset (bench/throw_probe.py maps those to functions with addr2line).
//   gcc -shared -fPIC -O1 -o /tmp/segv_trace.so bench/segv_trace.c
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static void on_fatal(int sig, siginfo_t* info, void* context) {
  (void)context;
  void* frames[64];
  int n = backtrace(frames, 64);
  dprintf(2, "segv_trace: signal %d, fault address %p, %d frames\n", sig, info->si_addr, n);
  for (int i = 0; i < n; ++i) {
    Dl_info d;
    if (dladdr(frames[i], &d) && d.dli_fname)
      dprintf(2, "segv_trace #%d %s+0x%lx %s\n", i, d.dli_fname,
              (unsigned long)((char*)frames[i] - (char*)d.dli_fbase), d.dli_sname ? d.dli_sname : "?");
    else
      dprintf(2, "segv_trace #%d %p ?\n", i, frames[i]);
  }
  signal(sig, SIG_DFL);
  raise(sig);
}

__attribute__((constructor)) static void install(void) {
  static char alt_stack[1 << 16];  // the handler must run even when the fault is a blown stack
  stack_t ss = {.ss_sp = alt_stack, .ss_size = sizeof alt_stack, .ss_flags = 0};
  sigaltstack(&ss, NULL);
  void* warm[2];
  backtrace(warm, 2);  // loads libgcc_s now: dlopen inside the handler could deadlock on malloc's lock
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_fatal;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigaction(SIGSEGV, &sa, NULL);
  sigaction(SIGBUS, &sa, NULL);
  sigaction(SIGABRT, &sa, NULL);
}
