/* Links libstrata through include/strata.h and checks the status strings. */
#include <stdio.h>
#include <string.h>

#include "strata.h"

int main(void) {
    int failures = 0;
    struct { int status; const char *name; } cases[] = {
        {STRATA_OK, "ok"},
        {STRATA_ERR_INVALID_ARGUMENT, "invalid argument"},
        {STRATA_ERR_IO, "i/o error"},
        {STRATA_ERR_CORRUPTED, "corrupted"},
        {STRATA_ERR_PERMISSION_DENIED, "permission denied"},
        {12345, "unknown status"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const char *got = strata_status_string(cases[i].status);
        if (strcmp(got, cases[i].name) != 0) {
            fprintf(stderr, "status %d: got \"%s\", want \"%s\"\n", cases[i].status, got, cases[i].name);
            failures++;
        }
    }
    if (strlen(strata_version()) == 0) {
        fprintf(stderr, "empty version\n");
        failures++;
    }
    printf("%d passed, %d failed\n", (int)(sizeof cases / sizeof cases[0]) + 1 - failures, failures);
    return failures != 0;
}
