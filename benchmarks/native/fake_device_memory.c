/* Preloaded into ggml's RPC server, it sets the memory the served CPU device reports: ggml's CPU device gives
 * sysconf(_SC_PHYS_PAGES) x the page size as both its free and total memory (ggml-cpu.cpp), so llama.cpp's --fit
 * sees a device of FAKE_DEVICE_MIB MiB. Every other sysconf name, and an unset variable, reach the real one. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <unistd.h>

long sysconf(int name) {
    static long (*real)(int) = NULL;
    if (!real) real = (long (*)(int)) dlsym(RTLD_NEXT, "sysconf");
    const char *mib = getenv("FAKE_DEVICE_MIB");
    if (name == _SC_PHYS_PAGES && mib && *mib) {
        return (long) (strtoull(mib, NULL, 10) * 1024ULL * 1024ULL / (unsigned long long) real(_SC_PAGE_SIZE));
    }
    return real(name);
}
