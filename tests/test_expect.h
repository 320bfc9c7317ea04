/* test_expect.h: expectations on calls that return moe_status. */
#ifndef MOE_TESTS_TEST_EXPECT_H
#define MOE_TESTS_TEST_EXPECT_H

#include <criterion/criterion.h>
#include <string.h>

#include "moe.h"

/* Expects that call failed with status and a message containing text. */
#define EXPECT_FAIL(call, status, text)                                                            \
    do {                                                                                           \
        moe_status st_ = (call);                                                                   \
        cr_expect_eq(st_, (status), "%s: got %s (%s)", #call, moe_status_string(st_),              \
                     moe_last_error());                                                            \
        cr_expect(strstr(moe_last_error(), (text)) != NULL, "%s: message '%s' lacks '%s'", #call, \
                  moe_last_error(), (text));                                                       \
    } while (0)

#define EXPECT_OK(call) cr_expect_eq((call), MOE_OK, "%s: %s", #call, moe_last_error())

#endif /* MOE_TESTS_TEST_EXPECT_H */
