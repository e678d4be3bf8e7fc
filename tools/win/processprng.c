/* bcryptprimitives.dll for Wine 8.0, which lacks it: Rust's standard library for Windows
 * (1.78 and later) takes its random bytes from ProcessPrng, and a program importing a DLL that
 * does not exist does not start. This one answers from RtlGenRandom (advapi32's
 * SystemFunction036), which Wine has. Only for running the Windows build under Wine: a real
 * Windows node has the system's own bcryptprimitives.dll, which is loaded instead of a copy
 * beside the program (it is a known DLL). */
#include <windows.h>

BOOLEAN WINAPI SystemFunction036(PVOID buffer, ULONG length);

BOOL WINAPI ProcessPrng(PBYTE data, SIZE_T length)
{
    while (length > 0) {
        ULONG chunk = length > 0x10000000 ? 0x10000000 : (ULONG)length;
        if (!SystemFunction036(data, chunk))
            return FALSE;
        data += chunk;
        length -= chunk;
    }
    return TRUE;
}
