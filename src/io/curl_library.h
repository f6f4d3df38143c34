// libcurl, loaded with dlopen when the first download starts instead of linked: kiln's binary then
// starts on a machine without libcurl (a GPU host it was carried to, as cudart is linked statically
// for the same reason), and only a download there fails, saying what is missing.
#pragma once

// The typed wrappers curl.h puts around curl_easy_setopt/getinfo for GCC are macros over the
// function names; calls here go through pointers.
#define CURL_DISABLE_TYPECHECK
#include <curl/curl.h>

namespace kiln {

struct CurlLibrary {
  decltype(&curl_global_init) global_init;
  decltype(&curl_easy_init) easy_init;
  decltype(&curl_easy_setopt) easy_setopt;
  decltype(&curl_easy_perform) easy_perform;
  decltype(&curl_easy_getinfo) easy_getinfo;
  decltype(&curl_easy_strerror) easy_strerror;
  decltype(&curl_easy_cleanup) easy_cleanup;
  decltype(&curl_slist_append) slist_append;
  decltype(&curl_slist_free_all) slist_free_all;
};

// The library, loaded and initialised (curl_global_init) once; a kiln::Error naming the library
// and how to install it when it cannot be loaded.
const CurlLibrary& libcurl();

}  // namespace kiln
