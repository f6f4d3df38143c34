#include "core/thread_stack.h"

#include <pthread.h>

#include <cstring>
#include <exception>

#include "core/error.h"

namespace kiln {
namespace {

struct Job {
  const std::function<void()>* work;
  std::exception_ptr error;
};

void* run_job(void* argument) {
  auto* job = static_cast<Job*>(argument);
  try {
    (*job->work)();
  } catch (...) {
    job->error = std::current_exception();
  }
  return nullptr;
}

}  // namespace

void run_with_stack(size_t stack_bytes, const std::function<void()>& work) {
  Job job{&work, nullptr};
  pthread_attr_t attributes;
  pthread_attr_init(&attributes);
  pthread_t thread;
  int status = pthread_attr_setstacksize(&attributes, stack_bytes);
  if (status == 0) status = pthread_create(&thread, &attributes, run_job, &job);
  pthread_attr_destroy(&attributes);
  if (status != 0) fail("cannot start a thread with a {}-byte stack: {}", stack_bytes, std::strerror(status));
  pthread_join(thread, nullptr);
  if (job.error) std::rethrow_exception(job.error);
}

}  // namespace kiln
