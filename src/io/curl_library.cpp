#include "io/curl_library.h"

#include <dlfcn.h>

#include <string>

#include "core/error.h"

namespace kiln {
namespace {

// libcurl's soname since 7.16 (2006): every libcurl a machine has today answers to it.
constexpr const char* kLibcurl = "libcurl.so.4";

template <typename Function>
void resolve(void* library, const char* name, Function& function) {
  function = reinterpret_cast<Function>(::dlsym(library, name));
  if (!function) fail("{} has no {}: kiln needs libcurl 7.68 or newer to download models", kLibcurl, name);
}

CurlLibrary load() {
  void* library = ::dlopen(kLibcurl, RTLD_NOW | RTLD_LOCAL);
  if (!library)
    fail("downloading needs libcurl, which cannot be loaded ({}); install it (Debian and Ubuntu: apt install "
         "libcurl4), or fetch the model elsewhere and pass its folder",
         ::dlerror());
  CurlLibrary curl{};
  resolve(library, "curl_global_init", curl.global_init);
  resolve(library, "curl_easy_init", curl.easy_init);
  resolve(library, "curl_easy_setopt", curl.easy_setopt);
  resolve(library, "curl_easy_perform", curl.easy_perform);
  resolve(library, "curl_easy_getinfo", curl.easy_getinfo);
  resolve(library, "curl_easy_strerror", curl.easy_strerror);
  resolve(library, "curl_easy_cleanup", curl.easy_cleanup);
  resolve(library, "curl_slist_append", curl.slist_append);
  resolve(library, "curl_slist_free_all", curl.slist_free_all);
  if (const CURLcode result = curl.global_init(CURL_GLOBAL_DEFAULT); result != CURLE_OK)
    fail("libcurl failed to initialise: {}", curl.easy_strerror(result));
  return curl;
}

}  // namespace

const CurlLibrary& libcurl() {
  // Loaded once and never unloaded: libcurl keeps global state for the life of the process.
  static const CurlLibrary curl = load();
  return curl;
}

}  // namespace kiln
