# The MPI tests, run by ctest through mpirun. Open MPI refuses to run as root
# and to start more ranks than cores unless told; CI runs as root on 2 cores.
add_executable(dist_mpi_test dist_mpi_test.cc)
target_include_directories(dist_mpi_test PRIVATE ${PROJECT_SOURCE_DIR})
target_link_libraries(dist_mpi_test PRIVATE fp8moe_mpi GTest::gtest)
add_executable(dist_fault_test dist_fault_test.cc)
target_include_directories(dist_fault_test PRIVATE ${PROJECT_SOURCE_DIR})
target_link_libraries(dist_fault_test PRIVATE fp8moe_mpi)

execute_process(COMMAND ${MPIEXEC_EXECUTABLE} --version OUTPUT_VARIABLE _mpiexec_version
                ERROR_QUIET)
set(_flags ${MPIEXEC_PREFLAGS})
if(_mpiexec_version MATCHES "Open MPI|OpenRTE")
  list(APPEND _flags --oversubscribe)
endif()
# The *_tcp variants: Open MPI without its shared-memory transport (vader),
# the ranks talking over TCP on the loopback device as ranks on different
# hosts talk over the network (ob1 is the point-to-point layer that uses
# these transports), so that nothing assumes every rank sits on one host.
# Not added with another MPI.
set(_tcp_flags)
if(_mpiexec_version MATCHES "Open MPI|OpenRTE")
  set(_tcp_flags --mca pml ob1 --mca btl self,tcp --mca btl_tcp_if_include lo)
endif()
# Cache (internal) so fp8moe_add_mpi_test and train/ see them from any directory.
set(FP8MOE_MPIEXEC_FLAGS "${_flags}" CACHE INTERNAL "mpiexec flags of the MPI tests")
set(FP8MOE_MPI_TCP_FLAGS "${_tcp_flags}" CACHE INTERNAL "mpiexec flags: TCP, no shared memory")
set(FP8MOE_MPI_TEST_ENV "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1"
    CACHE INTERNAL "environment of the MPI tests")
# The *_loaded variants run under this: a busy loop on every core, as on a
# machine whose cores other work keeps busy (under_load.sh).
set(FP8MOE_UNDER_LOAD bash ${CMAKE_CURRENT_SOURCE_DIR}/under_load.sh
    CACHE INTERNAL "runs a command with every core busy")

# fp8moe_add_mpi_test(NAME RANKS COMMAND...): COMMAND runs on RANKS ranks.
function(fp8moe_add_mpi_test name ranks)
  add_test(NAME ${name}
           COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${ranks} ${FP8MOE_MPIEXEC_FLAGS}
                   ${ARGN})
  # PROCESSORS 2: ctest -j2 runs an MPI job alone, never two at once.
  set_tests_properties(${name} PROPERTIES ENVIRONMENT "${FP8MOE_MPI_TEST_ENV}" TIMEOUT 300
                       PROCESSORS 2)
endfunction()

# Every test on 2 and 4 ranks; the ring-vs-MPI equality also on 1, 3, 5, 8.
foreach(ranks 2 4)
  fp8moe_add_mpi_test(dist_mpi_np${ranks} ${ranks} $<TARGET_FILE:dist_mpi_test>)
endforeach()
foreach(ranks 1 3 5 8)
  fp8moe_add_mpi_test(dist_mpi_ring_np${ranks} ${ranks} $<TARGET_FILE:dist_mpi_test>
                      --gtest_filter=RingVsMpi.*)
endforeach()

# Faults: a rank that dies or hangs ends the job on every rank, in bounded time.
foreach(mode abort exit hang)
  add_test(NAME dist_fault_${mode}
           COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/fault_test.sh ${mode}
                   $<TARGET_FILE:dist_fault_test> ${MPIEXEC_EXECUTABLE} ${FP8MOE_MPIEXEC_FLAGS})
  set_tests_properties(dist_fault_${mode} PROPERTIES ENVIRONMENT "${FP8MOE_MPI_TEST_ENV}"
                       TIMEOUT 120 PROCESSORS 2)
endforeach()
# The ranks that wait on a hung one all report the watchdog's timeout, also
# when every core is busy (the first to end the job used to cut the others
# off).
add_test(NAME dist_fault_hang_loaded
         COMMAND ${FP8MOE_UNDER_LOAD} bash ${CMAKE_CURRENT_SOURCE_DIR}/fault_test.sh hang
                 $<TARGET_FILE:dist_fault_test> ${MPIEXEC_EXECUTABLE} ${FP8MOE_MPIEXEC_FLAGS})
set_tests_properties(dist_fault_hang_loaded PROPERTIES ENVIRONMENT "${FP8MOE_MPI_TEST_ENV}"
                     TIMEOUT 120 PROCESSORS 2)
# Without shared memory: the collectives, and a rank that dies.
if(FP8MOE_MPI_TCP_FLAGS)
  fp8moe_add_mpi_test(dist_mpi_np2_tcp 2 ${FP8MOE_MPI_TCP_FLAGS} $<TARGET_FILE:dist_mpi_test>)
  add_test(NAME dist_fault_abort_tcp
           COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/fault_test.sh abort
                   $<TARGET_FILE:dist_fault_test> ${MPIEXEC_EXECUTABLE} ${FP8MOE_MPIEXEC_FLAGS}
                   ${FP8MOE_MPI_TCP_FLAGS})
  set_tests_properties(dist_fault_abort_tcp PROPERTIES ENVIRONMENT "${FP8MOE_MPI_TEST_ENV}"
                       TIMEOUT 120 PROCESSORS 2)
endif()
