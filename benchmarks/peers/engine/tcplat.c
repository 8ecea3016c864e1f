/* Lone WRITE/READ round trips (4 KiB unless said) over TCP loopback, two engines in two
 * processes, the initiator waiting as the adaptive loop does (axf_wait with
 * the engine's poll_us, then blocking on the eventfd). */
#define _GNU_SOURCE
#include "aioxfer.h"
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <dirent.h>
/* Context switches (voluntary+involuntary) of this process's threads, one
 * number per thread, with TCPLAT_CSW set. */
static void csw(const char *who){ if(!getenv("TCPLAT_CSW")) return; DIR*d=opendir("/proc/self/task"); struct dirent*t; fprintf(stderr,"%s csw:",who);
  while(d&&(t=readdir(d))){ if(t->d_name[0]=='.') continue; char p[64],l[128]; snprintf(p,sizeof p,"/proc/self/task/%s/status",t->d_name); FILE*f=fopen(p,"r"); long v=0,n=0; while(f&&fgets(l,sizeof l,f)){ sscanf(l,"voluntary_ctxt_switches: %ld",&v); sscanf(l,"nonvoluntary_ctxt_switches: %ld",&n);} if(f)fclose(f); if(v+n>50) fprintf(stderr," %ld/%ld",v,n);} if(d)closedir(d); fprintf(stderr,"\n");}
static uint64_t ns(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return (uint64_t)t.tv_sec*1000000000ull+(uint64_t)t.tv_nsec;}
static int cmp(const void*a,const void*b){uint64_t x=*(const uint64_t*)a,y=*(const uint64_t*)b;return x<y?-1:x>y;}
int main(int argc, char **argv){
  int N = argc>1?atoi(argv[1]):5000, NC = argc>2?atoi(argv[2]):4; size_t SZ = argc>3?strtoull(argv[3],0,0):4096;
  int ops = argc>4?(argv[4][0]=='w'?1:argv[4][0]=='r'?2:3):3; /* write, read or both */
  int ls=socket(AF_INET,SOCK_STREAM,0); struct sockaddr_in a={.sin_family=AF_INET,.sin_addr.s_addr=htonl(INADDR_LOOPBACK)};
  bind(ls,(void*)&a,sizeof a); listen(ls,16); socklen_t al=sizeof a; getsockname(ls,(void*)&a,&al);
  int pp[2]; pipe(pp); int qq[2]; pipe(qq);
  size_t REG=1<<20;
  pid_t pid=fork();
  if(!pid){ axf_engine*e=axf_engine_create(NULL); uint8_t*buf=malloc(REG); memset(buf,5,REG); /* touched: a READ's source must not be the zero page */ uint64_t rid,key;
    axf_region_register(e,buf,REG,AXF_ACCESS_READ|AXF_ACCESS_WRITE,-1,&rid,&key);
    write(pp[1],&rid,8); write(pp[1],&key,8);
    for(int i=0;i<NC;i++){int fd=accept(ls,0,0); axf_accept_conn(e,fd,100+i,-1);}
    char c; read(qq[0],&c,1); csw("target"); axf_engine_destroy(e); _exit(0);}
  uint64_t rid,key; read(pp[0],&rid,8); read(pp[0],&key,8);
  axf_engine*e=axf_engine_create(NULL); uint64_t ep; axf_endpoint_create(e,AXF_EP_TCP,1,0,-1,&ep);
  for(int i=0;i<NC;i++){int fd=socket(AF_INET,SOCK_STREAM,0); connect(fd,(void*)&a,sizeof a); axf_endpoint_add_conn(e,ep,fd);}
  uint8_t*src=malloc(REG); memset(src,3,REG); /* touched: reads of untouched calloc memory all hit the zero page (flattered WRITE, tcp8) */ uint64_t lrid,lkey; axf_region_register(e,src,REG,AXF_ACCESS_READ|AXF_ACCESS_WRITE,-1,&lrid,&lkey);
  axf_endpoint_import(e,ep,rid,key,REG,AXF_ACCESS_READ|AXF_ACCESS_WRITE,0,-1);
  uint32_t pus=axf_engine_poll_us(e); if(getenv("TCPLAT_SPIN_US")) pus=(uint32_t)atoi(getenv("TCPLAT_SPIN_US")); /* spin_alone's bound: up to 1000 */ int efd=axf_engine_fd(e);
  uint64_t*s=malloc(sizeof(uint64_t)*N);
  for(int op=0;op<2;op++){ if(!(ops&(1<<op))) continue;
    for(int i=-300;i<N;i++){
      axf_desc d={.lrid=lrid,.loff=0,.rrid=rid,.rkey=key,.roff=0,.len=SZ};
      uint64_t t0=ns();
      if(axf_post(e,ep,op?AXF_OP_READ:AXF_OP_WRITE,&d,1,NULL,0,(uint64_t)i+1000000,0)){fprintf(stderr,"post\n");return 1;}
      for(;;){ axf_completion c[8]; size_t n=axf_wait(e,pus); if(!n){struct pollfd pf={.fd=efd,.events=POLLIN}; poll(&pf,1,1000);} n=axf_poll(e,c,8); int done=0; for(size_t k=0;k<n;k++){ if(c[k].kind==AXF_CQ_XFER) done=1; axf_completion_free(&c[k]);} if(done)break;}
      if(i>=0)s[i]=ns()-t0;
    }
    qsort(s,N,8,cmp); printf("%s p50 %.1f us p90 %.1f p99 %.1f (poll_us %u, %d conns, %zu bytes)\n",op?"READ ":"WRITE",s[N/2]/1e3,s[N*9/10]/1e3,s[N*99/100]/1e3,pus,NC,SZ);
  }
  csw("initiator"); write(qq[1],"x",1); waitpid(pid,0,0); axf_engine_destroy(e); return 0;}
